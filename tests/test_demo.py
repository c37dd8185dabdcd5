"""`ampwatch demo` really serves, trains, overflows, meets its NaN, and says where to look."""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from ampwatch.server import db, store
from ampwatch.server.demo import NAN_AGAIN_AFTER, NAN_STEP_FRACTION, OVERFLOW_FRACTION, SPIKE_FRACTION


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_trains_an_unstable_run_and_prints_the_dashboard(tmp_path: Path) -> None:
    url, port, steps = f"sqlite:///{tmp_path / 'demo.db'}", _free_port(), 150
    command = [shutil.which("ampwatch") or "ampwatch", "demo", "--port", str(port), "--db", url]
    done = subprocess.run(
        command + ["--steps", str(steps), "--step-delay", "0", "--exit"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert f"ampwatch dashboard: http://127.0.0.1:{port}/" in done.stdout
    engine = db.make_engine(url)
    with db.session_factory(engine)() as session:
        [(run, project)] = store.list_runs(session)
        assert (project, run.status, run.last_step, run.health) == ("demo", "finished", steps - 1, "critical")
        assert f"Run page: http://127.0.0.1:{port}/runs/{run.id}" in done.stdout
        data = store.read_series(session, run_id=run.id, names=["loss", "scale"])
        events = [(e.step, e.type, e.details.get("origin")) for e in store.list_events(session, run_id=run.id)]
    engine.dispose()
    nan, spike, overflow = (int(steps * f) for f in (NAN_STEP_FRACTION, SPIKE_FRACTION, OVERFLOW_FRACTION))
    again = nan + NAN_AGAIN_AFTER
    nan_steps = [s for s, v in zip(*data["loss"]) if v is None or math.isnan(v)]
    assert nan_steps[:2] == [nan, again] and nan_steps[2] >= overflow
    assert min(data["scale"][1]) < 1.0 < max(data["scale"][1])
    # The story the demo tells, as diagnosed: calibration, a bad batch, its origin, a spike, a collapse.
    assert (50, "skipped_step", None) in events
    assert (nan, "nonfinite_loss", None) in events and (again, "nonfinite_loss", "(input batch)") in events
    assert (spike, "loss_spike", None) in events
    assert any(t == "nonfinite_loss" and origin == "blocks.2.fc" for _, t, origin in events)
    assert any(t == "scale_collapse" and s > overflow for s, t, _ in events)
    assert "What ampwatch diagnosed" in done.stdout


def test_demo_without_torch_says_how_to_install_it(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # makes `import torch` fail as if it were not installed
        "from ampwatch._cli import main\n"
        f"sys.exit(main(['demo', '--exit', '--port', '{_free_port()}', '--db', 'sqlite:///{tmp_path / 'd.db'}']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "pip install torch" in done.stderr
