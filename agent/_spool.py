"""The disk spool: one folder per (run, rank) holding `run.json` and one file per batch.

A batch is written (atomically: temporary file, then rename) before it is sent and deleted once the
server acknowledged it, so what a dead server or a dead process left behind is still there for the
next attempt or for `ampwatch sync`. The total size is capped; what does not fit is counted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # (Windows: no lock, so `ampwatch sync` cannot tell a live run's folder from a finished one's)
    # (fcntl is optional: absent on Windows)
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("ampwatch")
RUN_FILE = "run.json"
LOCK_FILE = ".lock"  # locked while a process writes to the folder (the lock goes with the process)


def default_root() -> Path:
    """`$AMPWATCH_SPOOL_DIR`, else the user's cache folder."""
    explicit = os.environ.get("AMPWATCH_SPOOL_DIR")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "ampwatch" / "spool"


class Spool:
    """Batch files of one (run, rank); every method returns instead of raising on a disk error."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self._warned = False
        self._lock: IO[bytes] | None = None
        self._bytes = sum(p.stat().st_size for p in folder.glob("*.json")) if folder.is_dir() else 0

    @classmethod
    def create(cls, root: Path, run_id: str, rank: int, run: dict[str, Any], max_bytes: int) -> Spool | None:
        """A new spool folder holding the run's registration; None when the disk refuses."""
        spool = cls(root / f"{run_id}.{rank}", max_bytes)
        try:
            spool.folder.mkdir(parents=True, exist_ok=True)
            _write(spool.folder / RUN_FILE, run)
        except OSError as error:
            log.warning("ampwatch: cannot spool to %s (%s); unsent batches are kept in memory only", root, error)
            return None
        if fcntl is not None:
            try:
                spool._lock = open(spool.folder / LOCK_FILE, "ab")  # noqa: SIM115 (held until close())
                fcntl.flock(spool._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another live process of this run and rank, or a file system without locks: none held
                spool.close()
        return spool

    def live(self) -> bool:
        """Whether a running process still writes to this folder (it holds the lock): `ampwatch sync` then leaves it."""
        if fcntl is None:
            return False
        try:
            with open(self.folder / LOCK_FILE, "ab") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False

    def close(self) -> None:
        """This process writes no more: let go of the lock."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def run(self) -> dict[str, Any]:
        """What `create` stored: run id, rank, server URL and the registration document."""
        return json.loads((self.folder / RUN_FILE).read_text())

    def put(self, seq: int, data: bytes) -> bool:
        """Persist one batch (its JSON bytes); False when the cap or the disk refuses it."""
        if self._bytes + len(data) > self.max_bytes:
            self._refused(f"it reached its {self.max_bytes}-byte cap")
            return False
        try:
            _write(self.folder / f"{seq:012d}.json", data)
        except OSError as error:
            self._refused(str(error))
            return False
        self._bytes += len(data)
        return True

    def load(self, seq: int) -> bytes:
        """One persisted batch's JSON bytes; ValueError when they are not JSON (a damaged file)."""
        data = (self.folder / f"{seq:012d}.json").read_bytes()
        json.loads(data)
        return data

    def remove(self, seq: int) -> None:
        """Forget an acknowledged batch."""
        path = self.folder / f"{seq:012d}.json"
        try:
            self._bytes -= path.stat().st_size
            path.unlink()
        except OSError:
            pass

    def set_aside(self, seq: int) -> None:
        """Rename an unreadable batch file to `.bad`, out of the queue but kept for a person to look at."""
        path = self.folder / f"{seq:012d}.json"
        try:
            os.replace(path, path.with_suffix(".bad"))
        except OSError:
            pass

    def pending(self) -> list[int]:
        """Sequence numbers still on disk, oldest first."""
        return sorted(int(p.stem) for p in self.folder.glob("[0-9]*.json"))

    def discard(self) -> None:
        """Remove the folder once everything in it was delivered (kept if a batch was set aside)."""
        self.close()
        if not any(self.folder.glob("*.bad")):
            shutil.rmtree(self.folder, ignore_errors=True)

    def _refused(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("ampwatch: the spool %s takes no more batches (%s)", self.folder, why)


def _write(path: Path, data: Any) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
    os.replace(temporary, path)
