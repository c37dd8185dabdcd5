"""The DeepSpeed integration with the real `deepspeed` package on the CPU: bf16 engines with ZeRO stages 0-2, and fp16
through torch_autocast (DeepSpeed's CPU accelerator refuses its own fp16). Skipped without deepspeed, also in CI: it is
not in the `dev` extra (its first engine on a fresh machine compiles a shared-memory communication op, about a minute
on two cores)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _ports import free_port

import ampwatch

try:
    import deepspeed
except ImportError as error:  # CI requires every integration: there a missing package fails instead of skipping
    if os.environ.get("AMPWATCH_REQUIRE_INTEGRATIONS"):
        raise
    pytest.skip(f"pip install deepspeed to test this integration ({error})", allow_module_level=True)
# DeepSpeed's CPU shared-memory all-reduce is a speed-up it compiles on first use (70-110 s on a 2-core machine):
# the tests run without it, as DeepSpeed itself does wherever it cannot build that op.
NO_SHM_OP = 'deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False'
exec(NO_SHM_OP)


@pytest.fixture
def one_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """DeepSpeed starts the process group from torchrun's variables (set here, for one process); the test ends it so
    that no later test runs inside it."""
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    yield
    if torch.distributed.is_initialized():
        deepspeed.comm.destroy_process_group()  # (DeepSpeed's own: it forgets its groups too)


def _engine(precision: dict[str, Any], stage: int = 0, accumulation: int = 2, **more: Any) -> Any:
    """A one-process engine (gradient accumulation 2 unless told; `more`: other config keys)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        **precision,
        **more,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_bf16_engine_records_loss_norm_lr_and_the_steps_it_skips_silently(
    sqlite_server, one_process: None, stage: int
) -> None:
    """ZeRO stages 0-2 under bf16: a step with non-finite gradients is skipped by the engine, without a word."""
    from ampwatch.deepspeed import watch_engine

    engine = _engine({"bf16": {"enabled": True}}, stage)
    steps, accumulation, bad = 6, 2, 3
    micro: list[float] = []
    with ampwatch.init(project="deepspeed", name="bf16", url=sqlite_server.url) as run:
        watch_engine(run, engine)
        for step in range(steps):
            for _ in range(accumulation):
                x = torch.randn(4, 16, dtype=torch.bfloat16)
                if step == bad:
                    x[0, 0] = float("inf")
                loss = engine(x).float().pow(2).mean()
                micro.append(loss.item() / accumulation)  # (the test reads it; the agent does not)
                engine.backward(loss)
                engine.step()
    assert engine.skipped_steps == 1  # the engine's own count: the non-finite step did not update the parameters

    with sqlite_server.client() as http:
        names = ["loss", "skipped", "grad_norm", "lr", "scale"]
        data = http.get(f"/api/v1/runs/{run.id}/series", params={"name": names}).json()
        events = http.get(f"/api/v1/runs/{run.id}/events").json()
    for name in ("loss", "skipped", "grad_norm", "lr"):
        assert data[name]["steps"] == list(range(steps)), name
    expected = [math.fsum(micro[i : i + accumulation]) for i in range(0, len(micro), accumulation)]
    assert data["loss"]["values"][:bad] == pytest.approx(expected[:bad], rel=1e-6)
    assert data["loss"]["values"][bad] in ("NaN", "Infinity")
    assert data["skipped"]["values"] == [0, 0, 0, 1, 0, 0]
    assert data["grad_norm"]["values"][bad] in ("NaN", "Infinity") and all(
        isinstance(v, float) and v > 0 for i, v in enumerate(data["grad_norm"]["values"]) if i != bad
    )
    assert data["lr"]["values"] == [1e-3] * steps
    assert data["scale"] == {"steps": [], "values": []}  # bf16 scales no loss
    [told] = [e for e in events if e["type"] == "nonfinite_loss"]
    assert (told["step"], told["severity"]) == (bad, "critical") and "did not change the parameters" in told["message"]


def test_the_documented_example_records_its_run(
    sqlite_server, one_process: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The complete example of docs/integrations/deepspeed.md, run as written (the server from AMPWATCH_URL)."""
    page = (Path(__file__).parent.parent / "docs" / "integrations" / "deepspeed.md").read_text()
    example = next(block for block in page.split("```python\n")[1:] if "engine.step()" in block and "for " in block)
    monkeypatch.setenv("AMPWATCH_URL", sqlite_server.url)
    monkeypatch.chdir(tmp_path)
    exec(compile(example.split("```")[0], "deepspeed.md", "exec"), {})
    with sqlite_server.client() as http:
        [run] = http.get("/api/v1/runs", params={"project": "deepspeed"}).json()
        data = http.get(f"/api/v1/runs/{run['id']}/series", params={"name": ["loss", "skipped"]}).json()
    assert (run["name"], run["status"]) == ("bf16-zero0", "finished")
    assert data["loss"]["steps"] == data["skipped"]["steps"] == list(range(8))
    assert data["skipped"]["values"] == [0] * 8


def test_an_fp16_autocast_engine_is_watched_through_its_gradscaler(sqlite_server, one_process: None) -> None:
    """`torch_autocast` with fp16 and no ZeRO: DeepSpeed scales with a torch GradScaler (on the CPU too) whose skips
    it does not count; the agent watches that scaler, so the skipped step is in the run."""
    from ampwatch.deepspeed import watch_engine

    engine = _engine({"torch_autocast": {"enabled": True, "dtype": "torch.float16"}})
    steps, accumulation, bad = 5, 2, 3
    micro: list[float] = []
    with ampwatch.init(project="deepspeed", name="fp16-autocast", url=sqlite_server.url) as run:
        watch_engine(run, engine)
        for step in range(steps):
            for _ in range(accumulation):
                x = torch.randn(4, 16)
                if step == bad:
                    x[0, 0] = float("inf")
                loss = engine(x).float().pow(2).mean()
                micro.append(loss.item() / accumulation)
                engine.backward(loss)
                engine.step()
    assert engine.skipped_steps == 0  # DeepSpeed's own count missed the GradScaler's skip

    with sqlite_server.client() as http:
        names = ["loss", "scale", "skipped", "grad_norm"]
        data = http.get(f"/api/v1/runs/{run.id}/series", params={"name": names}).json()
        events = http.get(f"/api/v1/runs/{run.id}/events").json()
        series = http.get(f"/api/v1/runs/{run.id}").json()["series"]
    assert {"grad_norm/0", "grad_norm/2"} <= set(series), series  # per-layer norms
    for name in ("loss", "scale", "skipped", "grad_norm"):
        assert data[name]["steps"] == list(range(steps)), name
    expected = [math.fsum(micro[i : i + accumulation]) for i in range(0, len(micro), accumulation)]
    assert data["loss"]["values"][:bad] == pytest.approx(expected[:bad], rel=1e-6)
    assert data["loss"]["values"][bad] in ("NaN", "Infinity")
    assert data["skipped"]["values"] == [0, 0, 0, 1, 0]
    assert data["scale"]["values"] == [2.0**16] * 4 + [2.0**15]
    [told] = [e for e in events if e["type"] == "nonfinite_loss"]
    assert (told["step"], told["severity"]) == (bad, "critical") and "GradScaler skipped the step" in told["message"]


TWO_RANKS = (
    """
import os, torch, deepspeed, torch.distributed as dist
import ampwatch
"""
    + NO_SHM_OP
    + """
from ampwatch.deepspeed import watch_engine

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "steps_per_print": 10**9}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
torch.manual_seed(1 + dist.get_rank())  # each rank its own data
with ampwatch.init(project="deepspeed-ranks", name="zero2", url=os.environ["SERVER"]) as run:
    watch_engine(run, engine)
    for step in range(6):
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        if step == 3 and dist.get_rank() == 1:
            x[0, 0] = float("inf")  # only rank 1's batch is bad
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
print(f"rank {dist.get_rank()} run {run.id}\\n", end="", flush=True)  # (one write: the ranks share a pipe)
"""
)


BUDGET_STEPS = 2000  # (a few thousand optimizer steps: the false-warning budget of each integration's loop)


@pytest.mark.parametrize(
    "precision",
    [{"torch_autocast": {"enabled": True, "dtype": "torch.float16"}}, {"bf16": {"enabled": True}}],
    ids=["fp16", "bf16"],
)
def test_a_healthy_engine_gets_no_warning_and_no_alert(
    sqlite_server, one_process: None, precision: dict[str, Any]
) -> None:
    """The false-warning budget, zero: a few thousand healthy optimizer steps of an engine watched by watch_engine,
    batches of 4, the engine's clipping and a warm-up LR schedule; fp16 through torch_autocast (a GradScaler: its
    start-up and occasional overflow skips included) and bf16."""
    from ampwatch.deepspeed import watch_engine

    warmup = {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 100}}
    engine = _engine(precision, accumulation=1, scheduler=warmup)
    dtype = torch.bfloat16 if "bf16" in precision else torch.float32
    with ampwatch.init(project="budget", name="deepspeed", url=sqlite_server.url) as run:
        watch_engine(run, engine)
        for _ in range(BUDGET_STEPS):
            x = torch.randn(4, 16)
            loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), x[:, :1].sin())
            engine.backward(loss)
            engine.step()
    with sqlite_server.client() as http:
        stored = http.get(f"/api/v1/runs/{run.id}").json()
        events = http.get(f"/api/v1/runs/{run.id}/events").json()
        alerts = http.get("/api/v1/alerts", params={"run_id": run.id}).json()
    assert (stored["status"], stored["last_step"]) == ("finished", BUDGET_STEPS - 1)
    warnings = [(e["type"], e["step"], e["message"]) for e in events if e["severity"] != "info"]
    assert (warnings, alerts, stored["health"]) == ([], [], "ok")


def test_two_zero2_ranks_report_into_one_run_and_both_skip_one_ranks_bad_batch(sqlite_server, tmp_path: Path) -> None:
    """Under torchrun: each rank starts its run after deepspeed.initialize, so the ranks share one run. ZeRO's
    overflow check is global: a bad batch on rank 1 makes both ranks skip the step, and each rank's series says so."""
    script = tmp_path / "train.py"
    script.write_text(TWO_RANKS)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {
        "SERVER": sqlite_server.url,
        "PATH": os.environ["PATH"],
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "OMP_NUM_THREADS": "1",
        "AMPWATCH_FLUSH_INTERVAL_S": "0.05",
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = {line.split()[-1] for line in done.stdout.splitlines() if line.startswith("rank")}
    with sqlite_server.client() as http:
        runs = http.get("/api/v1/runs", params={"project": "deepspeed-ranks"}).json()
        assert [r["id"] for r in runs] == list(ids) and len(ids) == 1
        by_rank = [
            http.get(f"/api/v1/runs/{runs[0]['id']}/series", params={"name": ["loss", "skipped"], "rank": rank}).json()
            for rank in (0, 1)
        ]
    assert (runs[0]["status"], runs[0]["environment"]["world_size"]) == ("finished", 2)
    for data in by_rank:
        assert data["skipped"] == {"steps": list(range(6)), "values": [0, 0, 0, 1, 0, 0]}
    assert math.isfinite(by_rank[0]["loss"]["values"][3]) and by_rank[1]["loss"]["values"][3] in ("NaN", "Infinity")
