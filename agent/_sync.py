"""`ampwatch sync DIR`: upload what offline runs, or runs whose server was down, left in the spool."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ampwatch._outbox import Outbox
from ampwatch._spool import RUN_FILE, Spool
from ampwatch._transport import HttpTransport

GIVE_UP_AFTER_S = 30.0


def sync(root: Path, url: str | None, token: str | None) -> int:
    """Upload every spooled run under `root` (or the run folder `root`), oldest batch first; 0 when all of it was
    acknowledged."""
    if not root.is_dir():
        print(f"no such folder: {root}", file=sys.stderr)
        return 2
    folders = [root] if (root / RUN_FILE).is_file() else sorted(p for p in root.glob("*") if (p / RUN_FILE).is_file())
    if not folders:
        print(f"nothing to upload in {root}")
        return 0
    failed = 0
    for folder in folders:
        spool = Spool(folder, max_bytes=1 << 62)
        try:
            info = spool.run()
            target = (url or info["url"]).rstrip("/")
            label = f"{info['doc']['project']}/{info['doc']['name']} (run {info['run_id']}, rank {info['rank']})"
        except (OSError, ValueError, KeyError, TypeError) as error:  # (a damaged run.json: the other runs still go)
            failed += 1
            print(f"{folder}: its {RUN_FILE} cannot be read ({error!r}); skipped", file=sys.stderr)
            continue
        outbox = Outbox(HttpTransport(target, token, 30.0), info["run_id"], info["doc"], spool)
        total = len(outbox)
        live = spool.live()  # (asked before the upload: a run that ends meanwhile may have written more)
        if not _drain(outbox):
            failed += 1
            print(
                f"{label}: {total - len(outbox)} of {total} uploaded; {target} did not take the rest", file=sys.stderr
            )
        elif outbox.refused:  # refused for good (a body limit, say): kept as .bad files for a person to look at
            failed += 1
            print(
                f"{label}: {total - outbox.dropped} of {total} uploaded; {target} refused {outbox.refused} "
                f"(see the error above), kept in {folder} as .bad files",
                file=sys.stderr,
            )
        elif live:
            print(
                f"{label}: {total} batch(es) uploaded to {target}; a running process still writes there: "
                "sync it again later"
            )
        else:
            spool.discard()
            print(f"{label}: {total} batch(es) uploaded to {target}")
    return 1 if failed else 0


def _drain(outbox: Outbox) -> bool:
    deadline = time.monotonic() + GIVE_UP_AFTER_S
    while not outbox.deliver():
        if time.monotonic() > deadline:
            return False
        time.sleep(max(0.0, min(outbox.retry_at - time.monotonic(), deadline - time.monotonic())))
    return True
