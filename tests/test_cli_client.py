"""The read commands (`ampwatch runs`, `run`, `events`, `series`, `alerts`, `watch`) against a real server filled
by a real watched torch loop; their exit codes when the server is down, the token is refused or the run is missing;
`runs delete`/`runs prune` and the runs list's paging."""

from __future__ import annotations

import csv
import io
import json
import re
import shlex
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from _runs import clipped_step
from conftest import free_port
from sqlalchemy import update

import ampwatch
from ampwatch import _cli
from ampwatch.server import auth, models


class Loop:
    """A watched fp16 loop on the CPU; each step also logs `probe` (Inf at step 3, else the step)."""

    def __init__(self, run: ampwatch.Run) -> None:
        torch.manual_seed(0)
        self.run = run
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.scaler = torch.amp.GradScaler("cpu")
        run.watch(model=self.model, optimizer=self.optimizer, scaler=self.scaler)

    def steps(self, steps: range, nan_at: int | None = None) -> None:
        """Train these steps; the batch at step `nan_at` holds a NaN (a critical `nonfinite_loss`)."""
        for step in steps:
            x = torch.randn(8, 4)
            if step == nan_at:
                x[0, 0] = float("nan")
            clipped_step(self.model, self.optimizer, self.scaler, x)
            self.run.log({"probe": float("inf") if step == 3 else float(step)}, step=step)


def _cli_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`ampwatch ARGV` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = _cli.main(list(argv))
    except SystemExit as exit_:  # argparse's usage errors
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _strict(text: str) -> Any:
    def refuse(constant: str) -> Any:
        raise AssertionError(f"bare {constant} in the JSON output")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def filled(sqlite_server, wait_for) -> tuple[Any, str]:
    """A real server holding one finished run with a NaN batch at step 20 and `probe` = Inf at 3; its alert stays
    firing (9 finite losses follow the NaN, one short of what clears a `nonfinite_loss` alert)."""
    with ampwatch.init("cli", name="tiny", url=sqlite_server.url) as run:
        Loop(run).steps(range(30), nan_at=20)
    with sqlite_server.client() as http:
        wait_for(lambda: http.get("/api/v1/alerts", params={"run_id": run.id, "state": "firing"}).json(), what="alert")
    return sqlite_server, run.id


def test_read_commands_print_tables_for_people_and_one_json_document_for_programs(filled, capsys, monkeypatch) -> None:
    server, run_id = filled
    monkeypatch.setenv("AMPWATCH_URL", server.url)

    code, out, _ = _cli_run(capsys, "runs")
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == ["ID", "PROJECT", "NAME", "STATUS", "HEALTH", "STEP", "LAST", "SEEN", "(UTC)"]
    assert row.split()[:6] == [run_id, "cli", "tiny", "finished", "critical", "29"]
    assert header.index("STATUS") == row.index("finished")  # aligned columns
    code, out, _ = _cli_run(capsys, "runs", "--project", "cli", "--json")
    assert code == 0 and [r["id"] for r in _strict(out)] == [run_id]
    assert _strict(_cli_run(capsys, "runs", "--project", "other", "--json")[1]) == []

    code, out, _ = _cli_run(capsys, "run", run_id)
    assert code == 0 and "finished" in out and f"/runs/{run_id}" in out and "probe" in out
    doc = _strict(_cli_run(capsys, "run", run_id, "--json")[1])
    assert (doc["id"], doc["status"], doc["last_step"], doc["ranks"]) == (run_id, "finished", 29, [0])

    code, out, _ = _cli_run(capsys, "events", run_id)
    assert code == 0 and any(line.split()[:4] == ["20", "0", "critical", "nonfinite_loss"] for line in out.splitlines())
    events = _strict(_cli_run(capsys, "events", run_id, "--json")[1])
    assert ("nonfinite_loss", 20, "critical") in [(e["type"], e["step"], e["severity"]) for e in events]

    code, out, _ = _cli_run(capsys, "alerts", "--run", run_id, "--state", "firing")
    assert code == 0 and "nonfinite_loss" in out and "critical" in out
    alerts = _strict(_cli_run(capsys, "alerts", "--json")[1])
    assert [(a["run_id"], a["rule"], a["state"]) for a in alerts] == [(run_id, "nonfinite_loss", "firing")]
    assert _strict(_cli_run(capsys, "alerts", "--state", "resolved", "--json")[1]) == []


def test_series_prints_exact_values_as_csv_json_or_a_table(filled, capsys, monkeypatch) -> None:
    server, run_id = filled
    monkeypatch.setenv("AMPWATCH_URL", server.url)
    code, out, _ = _cli_run(capsys, "series", run_id, "probe", "loss", "--json")
    data = _strict(out)
    assert code == 0 and data["probe"]["steps"] == list(range(30))
    assert data["probe"]["values"][3] == "Infinity" and data["probe"]["values"][4] == 4.0
    assert data["loss"]["values"][20] == "NaN"  # the NaN batch's loss, spelled as the API spells it

    code, out, _ = _cli_run(capsys, "series", run_id, "probe", "loss", "--csv")
    rows = list(csv.reader(io.StringIO(out)))
    assert code == 0 and rows[0] == ["step", "probe", "loss"] and len(rows) == 31
    assert rows[4][:2] == ["3", "Infinity"] and rows[21][0] == "20" and rows[21][2] == "NaN"

    code, out, _ = _cli_run(capsys, "series", run_id, "probe", "--max-points", "4", "--json")
    thin = _strict(out)["probe"]
    assert code == 0 and len(thin["steps"]) < 30 and "Infinity" in thin["values"]  # downsampling keeps non-finite

    code, out, _ = _cli_run(capsys, "series", run_id, "probe")
    assert (
        code == 0
        and out.splitlines()[0].split() == ["STEP", "PROBE"]
        and out.splitlines()[4].split() == ["3", "Infinity"]
    )
    code, _, err = _cli_run(capsys, "series", run_id, "probe", "nosuch", "--csv")
    assert code == 1 and "no series nosuch" in err


def test_failures_are_one_line_on_stderr_with_a_nonzero_exit(sqlite_server, capsys, monkeypatch) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code, out, err = _cli_run(capsys, "runs", "--url", closed)
    assert (code, out) == (1, "") and "cannot reach the ampwatch server" in err and err.count("\n") == 1
    monkeypatch.setenv("AMPWATCH_URL", closed)
    assert _cli_run(capsys, "alerts", "--json")[0] == 1  # the URL from the environment

    code, _, err = _cli_run(capsys, "run", "no-such-run", "--url", sqlite_server.url)
    assert code == 1 and "no run with id 'no-such-run'" in err
    assert _cli_run(capsys, "events", "no-such-run", "--url", sqlite_server.url)[0] == 1
    assert _cli_run(capsys, "series", "no-such-run", "loss", "--url", sqlite_server.url)[0] == 1

    assert _cli_run(capsys, "series", "some-run", "--url", sqlite_server.url)[0] == 2  # no series named
    code, _, err = _cli_run(capsys, "runs", "prune", "--older-than", "ninety days")
    assert code == 2 and "not a duration" in err
    assert _cli_run(capsys, "alerts", "--state", "pending")[0] == 2


def test_a_refused_token_says_which_variable_to_set(sqlite_server, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sqlite_server.app.state.tokens, "refresh_s", 0.0)  # tokens re-read per request
    with sqlite_server.app.state.sessions() as session:
        read = auth.create_token(session, name="cli", role="read")
        ingest = auth.create_token(session, name="agent", role="ingest")
    monkeypatch.setenv("AMPWATCH_URL", sqlite_server.url)
    code, _, err = _cli_run(capsys, "runs")
    assert code == 1 and "this server needs a token" in err and "AMPWATCH_TOKEN" in err
    code, _, err = _cli_run(capsys, "runs", "--token", "amw_1_" + "x" * 43)
    assert code == 1 and "the token was refused" in err and "AMPWATCH_TOKEN" in err
    code, _, err = _cli_run(capsys, "alerts", "--token", ingest)
    assert code == 1 and "forbidden" in err and "AMPWATCH_TOKEN" in err
    monkeypatch.setenv("AMPWATCH_TOKEN", read)
    code, out, _ = _cli_run(capsys, "runs", "--json")
    assert (code, _strict(out)) == (0, [])


def test_the_client_commands_need_no_server_dependency(filled) -> None:
    server, run_id = filled
    blocked = ("fastapi", "starlette", "sqlalchemy", "pydantic", "httpx", "uvicorn", "torch", "ampwatch.server")
    script = (
        f"import sys; sys.modules.update(dict.fromkeys({blocked!r}))\n"  # importing any of these now fails
        "from ampwatch._cli import main\n"
        f"sys.exit(main(['run', {run_id!r}, '--json', '--url', {server.url!r}]))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert _strict(done.stdout)["id"] == run_id


class Watch:
    """`ampwatch watch` as a real process, its stdout collected line by line."""

    def __init__(self, url: str, run_id: str) -> None:
        command = [sys.executable, "-m", "ampwatch._cli", "watch", run_id, "--url", url]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout or ()), daemon=True)
        self.reader.start()

    def printed(self, prefix: str) -> bool:
        return any(line.startswith(prefix) for line in list(self.lines))

    def result(self) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) once it exits."""
        code = self.process.wait(timeout=60)
        self.reader.join(timeout=10)
        return code, "".join(self.lines), self.process.stderr.read() if self.process.stderr else ""


def _watching(server, run: ampwatch.Run, wait_for) -> Watch:
    with server.client() as http:
        wait_for(lambda: http.get(f"/api/v1/runs/{run.id}").status_code == 200, what="the run registered")
    watch = Watch(server.url, run.id)
    wait_for(lambda: watch.printed(f"watching run {run.id}"), timeout_s=30, what="watch started")
    return watch


def test_watch_follows_a_run_and_exits_3_when_a_critical_alert_fires(sqlite_server, wait_for) -> None:
    with ampwatch.init("cli", name="doomed", url=sqlite_server.url) as run:
        loop = Loop(run)
        loop.steps(range(5))
        watch = _watching(sqlite_server, run, wait_for)
        loop.steps(range(5, 15))
        wait_for(lambda: watch.printed("step 14 "), what="watch showed step 14")
        loop.steps(range(15, 40), nan_at=25)
        code, out, err = watch.result()
    assert code == 3, (out, err)
    assert "ALERT [critical] nonfinite_loss" in out and "event [critical] step 25 nonfinite_loss" in out
    assert "loss=" in next(line for line in out.splitlines() if line.startswith("step 14 "))
    assert "a critical alert fired" in err


def test_watch_exits_0_when_the_run_finishes_across_stream_reconnections(sqlite_server, wait_for, monkeypatch) -> None:
    monkeypatch.setattr(sqlite_server.app.state.settings, "stream_lifetime_s", 0.2)  # watch reconnects all the time
    with ampwatch.init("cli", name="healthy", url=sqlite_server.url) as run:
        loop = Loop(run)
        loop.steps(range(5))
        watch = _watching(sqlite_server, run, wait_for)
        loop.steps(range(5, 10))
        wait_for(lambda: watch.printed("step 9 "), what="watch showed step 9")
        loop.steps(range(10, 20))
    code, out, err = watch.result()
    assert code == 0, (out, err)
    assert "step 19 " in out and out.rstrip().endswith("run finished")


def _register(http: Any, run_id: str, project: str, name: str) -> None:
    body = {"project": project, "name": name, "config": {}, "environment": {}}
    assert http.put(f"/api/v1/runs/{run_id}", json=body).status_code == 200


def test_runs_delete_and_prune_remove_runs_from_the_server(sqlite_server, capsys, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_URL", sqlite_server.url)
    with sqlite_server.client() as http:
        for run_id, project, name in (("r1", "p", "old"), ("r2", "p", "recent"), ("r3", "q", "other-old")):
            _register(http, run_id, project, name)
    with sqlite_server.app.state.sessions() as session:  # two runs last heard from 100 days ago
        stale = datetime.now(timezone.utc) - timedelta(days=100)
        session.execute(update(models.Run).where(models.Run.id.in_(["r1", "r3"])).values(last_seen_at=stale))
        session.commit()

    code, _, err = _cli_run(capsys, "runs", "delete", "r2")  # stdin is not a terminal here: no one to ask
    assert code == 2 and "--yes" in err
    code, out, _ = _cli_run(capsys, "runs", "delete", "r2", "--yes")
    assert code == 0 and "deleted run r2 (p/recent" in out
    code, _, err = _cli_run(capsys, "runs", "delete", "r2", "--yes")
    assert code == 1 and "no run with id 'r2'" in err

    code, out, err = _cli_run(capsys, "runs", "prune", "--older-than", "90d", "--project", "p", "--dry-run")
    assert code == 0 and "r1" in out and "r3" not in out and "would delete (dry run) 1 run" in err
    with sqlite_server.client() as http:
        assert http.get("/api/v1/runs/r1").status_code == 200  # a dry run removes nothing
    code, out, _ = _cli_run(capsys, "runs", "prune", "--older-than", "90d", "--json")
    doc = _strict(out)
    assert code == 0 and doc["deleted"] is True and sorted(r["id"] for r in doc["runs"]) == ["r1", "r3"]
    with sqlite_server.client() as http:
        assert [http.get(f"/api/v1/runs/{r}").status_code for r in ("r1", "r3")] == [404, 404]
    code, out, _ = _cli_run(capsys, "runs", "prune", "--older-than", "90d", "--json")
    assert code == 0 and _strict(out)["runs"] == []


def test_runs_follows_the_next_page_cursor(sqlite_server, capsys) -> None:
    with sqlite_server.client() as http:  # more runs than the server's first page holds (100)
        for i in range(105):
            _register(http, f"page-{i:03d}", "paged", f"run-{i}")
        assert len(http.get("/api/v1/runs", params={"project": "paged"}).json()) == 100
    code, out, _ = _cli_run(capsys, "runs", "--project", "paged", "--json", "--url", sqlite_server.url)
    assert code == 0 and sorted(r["id"] for r in _strict(out)) == [f"page-{i:03d}" for i in range(105)]


def _post_events(http: Any, run_id: str, seq: int, steps: range) -> None:
    events = [{"step": s, "type": "skipped_step", "severity": "info", "message": f"skip {s}"} for s in steps]
    assert http.post(f"/api/v1/runs/{run_id}/batches", json={"seq": seq, "events": events}).status_code == 200


def test_events_pages_by_limit_and_after_id_and_all_reads_every_page(sqlite_server, capsys, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_URL", sqlite_server.url)
    with sqlite_server.client() as http:
        _register(http, "long", "p", "long")
        _post_events(http, "long", 1, range(10_000))  # exactly one full page of the server's (10 000)
    code, out, err = _cli_run(capsys, "events", "long", "--all", "--json")
    every = _strict(out)
    assert (code, err) == (0, "") and [e["step"] for e in every] == list(range(10_000))
    with sqlite_server.client() as http:
        _post_events(http, "long", 2, range(10_000, 10_003))
    code, out, _ = _cli_run(capsys, "events", "long", "--all", "--json")
    every = _strict(out)
    assert code == 0 and [e["step"] for e in every] == list(range(10_003))
    assert len({e["id"] for e in every}) == 10_003

    code, out, err = _cli_run(capsys, "events", "long")  # the newest 1000: a full page says how to see the rest
    assert code == 0 and len(out.splitlines()) == 1001 and out.splitlines()[1].split()[0] == "9003"
    assert "may have more" in err and "--all" in err and err.count("\n") == 1
    code, out, err = _cli_run(capsys, "events", "long", "--limit", "3", "--json")
    assert [e["step"] for e in _strict(out)] == [10_000, 10_001, 10_002] and "--all" in err

    first = every[0]["id"]
    code, out, err = _cli_run(capsys, "events", "long", "--after-id", str(first), "--limit", "2", "--json")
    page = _strict(out)
    assert code == 0 and [e["step"] for e in page] == [1, 2] and f"--after-id {page[-1]['id']}" in err
    code, out, err = _cli_run(capsys, "events", "long", "--after-id", str(every[-3]["id"]), "--json")
    assert (code, [e["step"] for e in _strict(out)], err) == (0, [10_001, 10_002], "")  # not a full page: no hint
    code, out, _ = _cli_run(capsys, "events", "long", "--after-id", str(every[-5]["id"]), "--all")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == ["STEP", "9999", "10000", "10001", "10002"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--limit", "0"], "from 1 to 10000"),
        (["--limit", "10001"], "from 1 to 10000"),
        (["--limit", "ten"], "from 1 to 10000"),
        (["--all", "--limit", "5"], "not allowed with argument"),
        (["--after-id", "-1"], "not an event id"),
    ],
)
def test_events_paging_flags_that_make_no_sense_are_usage_errors(capsys, argv: list[str], says: str) -> None:
    code, out, err = _cli_run(capsys, "events", "some-run", *argv, "--url", f"http://127.0.0.1:{free_port()}")
    assert (code, out) == (2, "") and says in err, err


def test_the_documented_examples_run(filled, capsys, monkeypatch) -> None:
    server, run_id = filled
    monkeypatch.setenv("AMPWATCH_URL", server.url)
    page = (Path(__file__).parent.parent / "docs" / "cli.md").read_text()
    block = re.search(r"<!-- cli-examples -->\s*```bash\n(.+?)\n```", page, re.S)
    assert block, "docs/cli.md marks its examples"
    for line in block.group(1).splitlines():
        program, *argv = shlex.split(line.replace("$RUN", run_id))
        code, out, err = _cli_run(capsys, *argv)
        assert (program, code, err) == ("ampwatch", 0, ""), line
        if "--json" in argv:
            _strict(out)
        else:
            assert len(out.splitlines()) >= 2, line  # a header and at least one row


def test_watch_of_an_ended_run_says_at_once_whether_a_critical_alert_is_firing(filled, capsys) -> None:
    server, run_id = filled
    code, out, err = _cli_run(capsys, "watch", run_id, "--url", server.url)
    assert code == 3 and "ALERT [critical] nonfinite_loss" in out and "a critical alert fired" in err
