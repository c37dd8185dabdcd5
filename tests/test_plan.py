"""The rollback plan (`run.checkpoint()`, `GET /api/v1/runs/{id}/plan`, `ampwatch plan`) of real fp16 CPU loops
that checkpoint every few steps and then go bad: a gradient spike first, a loss-scale collapse later."""

from __future__ import annotations

import argparse
import json
import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from test_stream import sse

import ampwatch
from ampwatch import _cli
from ampwatch._protocol import batch_document, event
from ampwatch.server import auth, models, plan

EVERY = 10  # steps between checkpoints
SPIKE = 65  # the batch whose target is far off: a gradient and loss spike, the first sign
COLLAPSE_FROM = 74  # from here every gradient overflows at any scale: the scale collapses (critical)


def _train(server: Any, steps: int, *, bad: bool) -> str:
    """A watched fp16 loop that calls `run.checkpoint()` every `EVERY` steps; with `bad`, it spikes then collapses.
    Returns the run's id once it finished."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with ampwatch.init("plan", url=server.url) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            x = torch.randn(16, 8) * (3e37 if bad and step >= COLLAPSE_FROM else 1.0)
            target = torch.full((16, 1), 300.0 if bad and step == SPIKE else 0.0)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(model(x).float(), target)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if (step + 1) % EVERY == 0:  # the state after `step + 1` steps: the agent's current step
                run.checkpoint(path=f"ckpt/step-{step + 1}.pt")
    return run.id


def _cli_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`ampwatch ARGV` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = _cli.main(list(argv))
    except SystemExit as exit_:  # argparse's usage errors
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_the_plan_restores_the_last_checkpoint_before_the_first_sign_and_skips_to_past_the_collapse(
    live_server, capsys, tmp_path
) -> None:
    run_id = _train(live_server, 100, bad=True)
    with live_server.client() as http:
        events = http.get(f"/api/v1/runs/{run_id}/events").json()
        doc = http.get(f"/api/v1/runs/{run_id}/plan").json()
        lightning = http.get(f"/api/v1/runs/{run_id}/plan", params={"format": "lightning"})
        megatron = http.get(f"/api/v1/runs/{run_id}/plan", params={"format": "megatron"})
        assert http.get(f"/api/v1/runs/{run_id}/plan", params={"format": "csv"}).status_code == 422
        page = http.get(f"/runs/{run_id}", headers={"Accept": "text/html"}).text

    checkpoints = [e["step"] for e in events if e["type"] == "checkpoint"]
    assert checkpoints == list(range(EVERY, 101, EVERY))
    trouble = doc["trouble"]
    assert trouble["first_step"] == SPIKE and trouble["first_sign"]["type"] in ("loss_spike", "grad_spike")
    assert trouble["first_sign"]["severity"] == "warning"
    assert trouble["first_sign"] == next(e for e in events if e["id"] == trouble["first_sign"]["id"])  # as listed
    critical = trouble["critical"]
    assert {e["severity"] for e in critical} == {"critical"} and "scale_collapse" in {e["type"] for e in critical}
    assert trouble["critical_step"] == next(e["step"] for e in critical if e["type"] == "scale_collapse")
    assert critical[0]["step"] >= COLLAPSE_FROM
    # Checkpoint 70 was saved before the first critical event, but after the trouble began: not the one to restore.
    assert 70 < critical[0]["step"]
    assert doc["checkpoint"] == {"step": 60, "rank": 0, "path": "ckpt/step-60.pt"}
    last_critical = critical[-1]["step"]
    steps = list(range(SPIKE, last_critical + plan.MARGIN + 1))
    assert doc["skip"] == {"from": SPIKE, "to": last_critical + plan.MARGIN, "steps": steps}
    assert "restore the checkpoint at step 60 (ckpt/step-60.pt)" in doc["summary"]
    assert doc["files"]["lightning"].endswith("?format=lightning")

    # Lightning's SpikeDetection writes json.dump(bad_batches, f, indent=4): a list of batch indices.
    assert lightning.status_code == 200 and lightning.headers["content-type"].startswith("application/json")
    assert 'filename="skip_batches.json"' in lightning.headers["content-disposition"]
    assert lightning.text == json.dumps(steps, indent=4) and json.loads(lightning.text) == steps
    # Megatron-LM takes `--iterations-to-skip N [N ...]` (nargs="+", type=int).
    megatron_args = argparse.ArgumentParser()
    megatron_args.add_argument("--iterations-to-skip", nargs="+", type=int, default=[])
    assert megatron.headers["content-type"].startswith("text/plain")
    assert megatron_args.parse_args(["--iterations-to-skip", *megatron.text.split()]).iterations_to_skip == steps
    assert megatron.text == " ".join(map(str, steps)) + "\n"

    # The run page shows the plan, with a link to each file.
    section = page[page.index('id="run-plan"') : page.index('id="run-alerts"')]
    assert '<td id="plan-checkpoint">step 60 <code>ckpt/step-60.pt</code></td>' in section
    assert f'<td id="plan-skip">{SPIKE}–{last_critical + plan.MARGIN} ({len(steps)} steps)</td>' in section
    for kind in ("lightning", "megatron"):
        assert f'href="/api/v1/runs/{run_id}/plan?format={kind}"' in section

    code, out, err = _cli_run(capsys, "plan", run_id, "--url", live_server.url)
    assert (code, err) == (0, "")
    assert out.startswith(doc["summary"]) and "step 60 (ckpt/step-60.pt)" in out
    assert f"{SPIKE}-{last_critical + plan.MARGIN} ({len(steps)} steps)" in out
    code, out, _ = _cli_run(capsys, "plan", run_id, "--url", live_server.url, "--json")
    assert code == 0 and {k: v for k, v in json.loads(out).items()} == doc
    code, out, _ = _cli_run(capsys, "plan", run_id, "--url", live_server.url, "--format", "megatron")
    assert (code, out) == (0, megatron.text)
    target = tmp_path / "skip_batches.json"
    code, out, err = _cli_run(
        capsys, "plan", run_id, "--url", live_server.url, "--format", "lightning", "-o", str(target)
    )
    assert (code, out, err.strip()) == (0, "", f"wrote {target}")
    assert json.loads(target.read_text()) == steps


def test_a_healthy_run_has_no_trouble_and_empty_files(sqlite_server, capsys) -> None:
    run_id = _train(sqlite_server, 40, bad=False)
    with sqlite_server.client() as http:
        doc = http.get(f"/api/v1/runs/{run_id}/plan").json()
        lightning = http.get(f"/api/v1/runs/{run_id}/plan", params={"format": "lightning"}).text
        megatron = http.get(f"/api/v1/runs/{run_id}/plan", params={"format": "megatron"}).text
        page = http.get(f"/runs/{run_id}", headers={"Accept": "text/html"}).text
    assert (doc["trouble"], doc["checkpoint"], doc["skip"]) == (None, None, None)
    assert 'id="run-alerts"' in page and 'id="run-plan"' not in page
    assert (json.loads(lightning), megatron) == ([], "")
    code, out, err = _cli_run(capsys, "plan", run_id, "--url", sqlite_server.url)
    assert (code, out, err) == (0, doc["summary"] + "\n", "")
    assert "nothing to roll back" in out


def test_checkpoint_takes_a_step_and_a_path_and_never_raises(
    sqlite_server, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ampwatch.init("plan", url=sqlite_server.url) as run:
        run.checkpoint()  # before any step: step 0, no path
        run.checkpoint(step=7, path=Path("/ckpt") / "seven.pt")
        with caplog.at_level(logging.WARNING, logger="ampwatch"):
            run.checkpoint(step=-1)
            run.checkpoint(step="12")
    assert "checkpoint()'s step must be an integer" in caplog.text
    with sqlite_server.client() as http:
        events = http.get(f"/api/v1/runs/{run.id}/events").json()
    saved = [(e["step"], e["severity"], e["details"]) for e in events if e["type"] == "checkpoint"]
    assert saved == [(0, "info", {"path": None}), (7, "info", {"path": "/ckpt/seven.pt"})]
    monkeypatch.setenv("AMPWATCH_MODE", "disabled")
    offline = ampwatch.init("plan")
    offline.checkpoint(step=3, path="x")  # a disabled run records nothing, and says nothing
    offline.finish()


def test_plan_of_an_unknown_run_is_a_404_and_exit_1(sqlite_server, capsys) -> None:
    with sqlite_server.client() as http:
        assert http.get("/api/v1/runs/nope/plan").status_code == 404
    code, out, err = _cli_run(capsys, "plan", "nope", "--url", sqlite_server.url)
    assert (code, out) == (1, "") and err.startswith("ampwatch plan: no run with id 'nope'")
    code, _, err = _cli_run(capsys, "plan", "nope", "--json", "--format", "megatron")
    assert code == 2 and "not allowed with" in err


def test_a_grad_spike_before_nonfinite_parameters_is_where_trouble_began(
    sqlite_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a scaler (bf16) nothing skips a bad step: a gradient spike at 45, then parameters gone non-finite."""
    monkeypatch.setenv("AMPWATCH_PARAM_CHECK_INTERVAL", "1")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    with ampwatch.init("plan", url=sqlite_server.url) as run:
        run.watch(model=model, optimizer=optimizer)
        for step in range(70):
            x = torch.randn(16, 8) * (float("inf") if step == 55 else 1.0)
            target = torch.full((16, 1), 300.0 if step == 45 else 0.0)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if (step + 1) % EVERY == 0:
                run.checkpoint(step=step + 1, path=f"ckpt/{step + 1}")
    with sqlite_server.client() as http:
        doc = http.get(f"/api/v1/runs/{run.id}/plan").json()
    trouble = doc["trouble"]
    assert (trouble["first_step"], trouble["first_sign"]["type"]) == (45, "grad_spike")
    assert trouble["critical_step"] == 55 and ("nonfinite_param", 55) in [
        (e["type"], e["step"]) for e in trouble["critical"]
    ]
    assert doc["checkpoint"]["step"] == 40  # not 50, the last before the non-finite parameters
    assert doc["skip"]["from"] == 45 and doc["skip"]["to"] == trouble["critical"][-1]["step"] + plan.MARGIN


def _event(step: int, type_: str, severity: str, path: str | None = None) -> models.Event:
    details = {"path": path} if type_ == "checkpoint" else {}
    now = datetime.now(timezone.utc)
    return models.Event(
        id=step, run_id="r", step=step, rank=0, type=type_, severity=severity, message="", details=details, time=now
    )


@pytest.mark.parametrize(
    ("signs", "checkpoints", "expected"),
    [
        # An earlier, separate episode (more than EPISODE_GAP steps before) is not where this trouble began.
        (
            [(100, "loss_spike", "warning"), (400, "grad_spike", "warning"), (450, "scale_collapse", "critical")],
            [350, 420],
            (400, 350, 400, 455),
        ),
        # A checkpoint saved at the first sign's own step is not trusted; none before it: start over.
        ([(30, "skipped_step", "warning"), (31, "nonfinite_param", "critical")], [30], (30, None, 30, 36)),
        # The criticals that follow within the gap belong to the episode: the skip runs past the last one.
        (
            [
                (10, "nonfinite_loss", "critical"),
                (60, "scale_collapse", "critical"),
                (300, "nonfinite_param", "critical"),
            ],
            [5],
            (10, 5, 10, 65),
        ),
        # A NaN loss the scaler skipped is a sign, not a trigger: the plan is about the collapse after it.
        (
            [
                (10, "nonfinite_loss", "critical"),
                (300, "nonfinite_loss", "critical"),
                (350, "scale_collapse", "critical"),
            ],
            [5, 250, 320],
            (300, 250, 300, 355),
        ),
        # A skip range never lists more than MAX_SKIP steps.
        (
            [(i * 100, "skipped_step", "warning") for i in range(200)] + [(20_000, "scale_collapse", "critical")],
            [],
            (0, None, 0, plan.MAX_SKIP - 1),
        ),
    ],
)
def test_episodes_checkpoints_and_skips(
    signs: list[tuple[int, str, str]], checkpoints: list[int], expected: tuple[int, int | None, int, int]
) -> None:
    doc = plan.compute(
        "r", [_event(*s) for s in signs], [_event(c, "checkpoint", "info", f"c{c}") for c in checkpoints]
    )
    restored = doc["checkpoint"]["step"] if doc["checkpoint"] else None
    assert (doc["trouble"]["first_step"], restored, doc["skip"]["from"], doc["skip"]["to"]) == expected
    assert doc["skip"]["steps"] == list(range(expected[2], expected[3] + 1))
    assert ("restart from the beginning" in doc["summary"]) == (restored is None)


def test_warnings_and_skipped_nans_without_a_trigger_are_no_trouble() -> None:
    signs = [
        _event(5, "grad_spike", "warning"),
        _event(9, "skipped_step", "warning"),
        _event(9, "nonfinite_loss", "critical"),
    ]
    doc = plan.compute("r", signs, [])
    assert (doc["trouble"], doc["skip"], plan.lightning_file(doc), plan.megatron_file(doc)) == (None, None, "[]", "")


def test_a_leading_indicator_before_the_episode_moves_the_checkpoint_back_not_the_skips() -> None:
    leading = _event(2700, "leading_indicator", "warning")
    leading.details = {"indicator": "update_ratio"}
    far = _event(500, "amp_config", "warning")
    far.details = {"indicator": "fp16_range"}  # more than LEADING_REACH before the trouble: another story
    unrelated = _event(2750, "amp_config", "warning")  # a config warning, no indicator: not a leading sign
    signs = [_event(3000, "grad_spike", "warning"), _event(3010, "nonfinite_param", "critical")]
    checkpoints = [_event(c, "checkpoint", "info", f"c{c}") for c in (400, 2500, 2800, 2900)]
    doc = plan.compute("r", signs, checkpoints, [e for e in (far, leading, unrelated) if e.details])
    assert (doc["trouble"]["began"], doc["trouble"]["leading"]["step"], doc["checkpoint"]["step"]) == (2700, 2700, 2500)
    assert (doc["skip"]["from"], doc["skip"]["to"]) == (3000, 3015)
    assert doc["summary"].startswith("A leading indicator warned at step 2700.")
    without = plan.compute("r", signs, checkpoints)
    assert (without["trouble"]["began"], without["checkpoint"]["step"]) == (3000, 2900)


def test_the_plan_is_a_read_route(sqlite_server, capsys, monkeypatch, wait_for) -> None:
    monkeypatch.setattr(sqlite_server.app.state.tokens, "refresh_s", 0.0)  # tokens re-read per request
    with sqlite_server.app.state.sessions() as session:
        read = auth.create_token(session, name="cli", role="read")
        ingest = auth.create_token(session, name="agent", role="ingest")
    with sqlite_server.client() as http:
        reader = {"Authorization": f"Bearer {read}"}
        wait_for(lambda: http.get("/api/v1/runs", headers=reader).status_code == 200, what="the tokens")
        with ampwatch.init("plan", url=sqlite_server.url, token=ingest) as run:
            run.checkpoint(step=3)
        path = f"/api/v1/runs/{run.id}/plan"
        assert http.get(path, headers=reader).status_code == 200
        assert http.get(path).status_code == 401
        assert http.get(path, headers={"Authorization": f"Bearer {ingest}"}).status_code == 403
    code, out, _ = _cli_run(capsys, "plan", run.id, "--url", sqlite_server.url, "--token", read, "--json")
    assert code == 0 and json.loads(out)["trouble"] is None
    code, out, err = _cli_run(capsys, "plan", run.id, "--url", sqlite_server.url)
    assert (code, out) == (1, "") and "this server needs a token" in err and "AMPWATCH_TOKEN" in err


def test_a_plan_trigger_carries_the_plan_in_brief_in_the_events_api_the_stream_and_ampwatch_events(
    sqlite_server, capsys, monkeypatch
) -> None:
    loads: list[str] = []
    real_load = plan.load
    monkeypatch.setattr(plan, "load", lambda session, run_id: loads.append(run_id) or real_load(session, run_id))
    said = [
        event(10, 0, "checkpoint", "info", "checkpoint", {"path": "ckpt/10.pt"}),
        event(15, 0, "grad_spike", "warning", "grad norm 40x its median", {}),
        event(20, 0, "scale_collapse", "critical", "the scale collapsed", {}),
        event(22, 0, "nonfinite_param", "critical", "parameters are NaN", {}),
        event(22, 0, "nonfinite_loss", "critical", "NaN loss (a sign, not a trigger)", {}),
    ]
    with sqlite_server.client() as http:
        assert http.put("/api/v1/runs/t1", json={"project": "plan", "name": "trig"}).is_success
        assert http.post("/api/v1/runs/t1/batches", json=batch_document(0, 1, {}, said[:2], None)).is_success
        with sse(http, "/api/v1/runs/t1/stream", params={"after_event": 0}) as stream:
            stream.until(lambda d: len(d["events"]) == 2)
            assert loads == []  # (no trigger among the streamed events: no plan computed)
            assert http.post("/api/v1/runs/t1/batches", json=batch_document(0, 2, {}, said[2:], None)).is_success
            streamed = stream.until(lambda d: d["events"])[-1]["data"]["events"]
        doc = http.get("/api/v1/runs/t1/plan").json()
        del loads[:]
        events = http.get("/api/v1/runs/t1/events").json()
        assert loads == ["t1"]  # once for the page, with its two triggers
        first_two = http.get("/api/v1/runs/t1/events", params={"after_id": 0, "limit": 2}).json()
        assert loads == ["t1"]  # a page without a trigger computes none

    brief = {
        "summary": doc["summary"],
        "checkpoint": {"step": 10, "rank": 0, "path": "ckpt/10.pt"},
        "skip": {"from": 15, "to": 22 + plan.MARGIN},
        "path": "/api/v1/runs/t1/plan",
    }
    assert doc["summary"].startswith("Trouble began at step 15 (grad_spike) before the scale_collapse at step 20")
    carrying = [(e["type"], e["plan"]) for e in events if "plan" in e]
    assert carrying == [("scale_collapse", brief), ("nonfinite_param", brief)]
    assert [e["type"] for e in streamed] == ["scale_collapse", "nonfinite_param", "nonfinite_loss"]
    assert [e.get("plan") for e in streamed] == [brief, brief, None] and "plan" not in streamed[2]
    assert all("plan" not in e for e in first_two)
    assert [e for e in events if "plan" not in e][:2] == first_two  # (the same objects as before the plan existed)

    code, out, _ = _cli_run(capsys, "events", "t1", "--url", sqlite_server.url)
    assert code == 0
    lines = [line for line in out.splitlines() if "Rollback plan:" in line]
    assert len(lines) == 2 and all(f"Rollback plan: {doc['summary']} (ampwatch plan t1)" in line for line in lines)
    code, out, _ = _cli_run(capsys, "events", "t1", "--url", sqlite_server.url, "--json")
    assert code == 0 and json.loads(out) == events
