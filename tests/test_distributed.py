"""Two ranks on the CPU (gloo): DDP, FSDP2 and tensor parallelism launched by torchrun, and Lightning's own DDP launch.
Each rank reports its own records into one run, tagged with its rank, and the agent issues no collective of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = """
import os, torch, torch.distributed as dist
import ampwatch

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
if SYNC:  # (else each rank trains its own replica: gradients never all-reduced, as under a broken setup)
    model = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
torch.manual_seed(1 + dist.get_rank())  # each rank sees its own data
with ampwatch.init("ddp", "two-ranks", url=os.environ["SERVER"]) as run:
    run.watch(model=model, optimizer=optimizer, scaler=scaler)
    for step in range(STEPS):
        x = torch.randn(4, 8)
        if step == 5 and dist.get_rank() == 1:
            x[0, 0] = float("inf")  # only rank 1 overflows; DDP's all-reduce makes both ranks skip
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if PERTURB and step == 8 and dist.get_rank() == 1:  # one rank's parameters change: DDP never notices
            with torch.no_grad():
                model.module[0].weight[0, 0] += 1e-3
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
print(f"rank {dist.get_rank()} run {run.id}\\n", end="", flush=True)  # (one write: the ranks share a pipe)
dist.destroy_process_group()
"""


def _launch(server: Any, tmp_path: Path, steps: int, sync: bool, text: str = SCRIPT, perturb: bool = False) -> set[str]:
    """Two ranks of the script under torchrun, checking the parameters (`param_norm`) every step; the run ids they
    printed."""
    script = tmp_path / "ddp_train.py"
    text = text.replace("STEPS", str(steps)).replace("SYNC", str(sync)).replace("PERTURB", str(perturb))
    script.write_text(text.replace("OUT", repr(str(tmp_path))))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {"SERVER": server.url, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "AMPWATCH_FLUSH_INTERVAL_S": "0.05"}
    env["AMPWATCH_PARAM_CHECK_INTERVAL"] = "1"
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return {line.split()[-1] for line in done.stdout.splitlines() if line.startswith("rank")}


FSDP2 = """
import json, os, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
import ampwatch

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
for layer in (model[0], model[2], model):
    fully_shard(layer)  # each rank holds half of each parameter's rows: parameters and gradients are DTensors
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = ShardedGradScaler("cpu")
torch.manual_seed(1 + dist.get_rank())
seen = {"norms": [], "layer0": None}
with ampwatch.init("fsdp", "two-shards", url=os.environ["SERVER"]) as run:
    run.watch(model=model, optimizer=optimizer, scaler=scaler)
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if step == 0:  # the whole first layer's gradient norm (a collective of this script's, on every rank alike)
            grads = [p.grad.full_tensor() for p in model[0].parameters()]
            seen["layer0"] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # a DTensor, replicated on every rank
        seen["norms"].append(norm.to_local().item())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
with open(os.path.join(OUT, f"seen{dist.get_rank()}.json"), "w") as f:
    json.dump(seen, f)
print(f"rank {dist.get_rank()} run {run.id}\\n", end="", flush=True)  # (one write: the ranks share a pipe)
dist.destroy_process_group()
"""


def test_fsdp2_shards_report_the_global_grad_norm_and_their_shards_layer_norms(sqlite_server, tmp_path: Path) -> None:
    """FSDP2 (fully_shard) with ShardedGradScaler: the norms the agent keeps are DTensors, which it reads as each rank's
    local tensor, with no collective (it dropped every step's record before: a DTensor has no tolist())."""
    import json
    import math

    steps = 8
    [run_id] = _launch(sqlite_server, tmp_path, steps, sync=True, text=FSDP2)
    seen = [json.loads((tmp_path / f"seen{rank}.json").read_text()) for rank in (0, 1)]
    with sqlite_server.client() as http:
        run = http.get(f"/api/v1/runs/{run_id}").json()
        series = {
            rank: http.get(
                f"/api/v1/runs/{run_id}/series", params={"name": ["grad_norm", "grad_norm/0", "skipped"], "rank": rank}
            ).json()
            for rank in (0, 1)
        }
    assert (run["last_step"], run["ranks"]) == (steps - 1, [0, 1])
    for rank in (0, 1):  # clip_grad_norm_'s total is replicated: each rank records the whole norm, exactly
        assert series[rank]["grad_norm"]["steps"] == list(range(steps))
        assert series[rank]["grad_norm"]["values"] == [
            v if math.isfinite(v) else str(v).replace("inf", "Infinity") for v in seen[rank]["norms"]
        ]
    # Per-layer norms: each rank's shard's; together they make the layer's.
    shards = [series[rank]["grad_norm/0"]["values"][0] for rank in (0, 1)]
    assert 0 < shards[0] != shards[1] > 0
    assert math.isclose(math.hypot(*shards), seen[0]["layer0"], rel_tol=1e-5)
    assert (
        series[0]["skipped"]["values"] == series[1]["skipped"]["values"]
    )  # found_inf all-reduced by ShardedGradScaler
    assert _disagreements(sqlite_server, run_id) == []
    assert run["environment"]["parallel"] == "sharded" and _desyncs(sqlite_server, run_id) == []  # (shards' norms)


TENSOR_PARALLEL = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from ampwatch._origin import OriginProbe

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
plan = {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel(use_local_output=False)}
parallelize_module(model, init_device_mesh("cpu", (2,)), plan)  # the layers' outputs are DTensors, sharded or partial
probe = OriginProbe(model)
counts = []
for armed in (False, True):
    if armed:
        probe.arm()
    with CommDebugMode() as comm:
        model(torch.randn(4, 8)).full_tensor().pow(2).mean().backward()
    counts.append(comm.get_total_counts())
names, forward, _, backward = probe.take()
plain = all(flag.__class__ is torch.Tensor for flag in forward + backward)
fields = ("rank", dist.get_rank(), "collectives", *counts, "flags", len(forward), len(backward), "plain", plain)
print(" ".join(map(str, fields)) + "\\n", end="", flush=True)  # (one write: the ranks share a pipe)
dist.destroy_process_group()
"""


def test_the_nan_origin_probe_issues_no_collective_on_a_tensor_parallel_model(tmp_path: Path) -> None:
    """Each rank arms its probe when its own sender has seen a non-finite value, so not at the same step as the others:
    a collective of the probe's (reducing a sharded output's flag) would wait for ranks that never issue it."""
    script = tmp_path / "tp.py"
    script.write_text(TENSOR_PARALLEL)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=180, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank"))
    assert len(lines) == 2, done.stdout
    for line in lines:
        _, _, _, unarmed, armed, _, forward, backward, _, plain = line.split()
        assert armed == unarmed and int(unarmed) > 0, line  # the model's own collectives only
        assert int(forward) == 4 and int(backward) == 3 and plain == "True", line  # (input, 3 layers; 3 gradients)


def _disagreements(server: Any, run_id: str) -> list[dict[str, Any]]:
    with server.client() as http:
        events = http.get(f"/api/v1/runs/{run_id}/events").json()
    return [e for e in events if e["details"].get("cause") == "ranks_disagree"]


def _desyncs(server: Any, run_id: str) -> list[dict[str, Any]]:
    with server.client() as http:
        events = http.get(f"/api/v1/runs/{run_id}/events").json()
    return [e for e in events if e["type"] == "ranks_desync"]


def _param_norms(server: Any, run_id: str) -> list[list[Any]]:
    with server.client() as http:
        series = [
            http.get(f"/api/v1/runs/{run_id}/series", params={"name": "param_norm", "rank": r}).json()["param_norm"]
            for r in (0, 1)
        ]
    assert series[0]["steps"] == series[1]["steps"]
    return [s["values"] for s in series]


def test_two_ddp_ranks_report_into_one_run_each_with_its_rank(sqlite_server, tmp_path: Path) -> None:
    steps = 12
    ids = _launch(sqlite_server, tmp_path, steps, sync=True)
    with sqlite_server.client() as http:
        runs = http.get("/api/v1/runs", params={"project": "ddp"}).json()
        assert [r["id"] for r in runs] == list(ids)  # both ranks chose the same run id, without talking
        run = runs[0]
        names = http.get(f"/api/v1/runs/{run['id']}").json()["series"]
        assert (run["status"], run["environment"]["world_size"], run["last_step"]) == ("finished", 2, steps - 1)
        by_rank = {
            rank: http.get(
                f"/api/v1/runs/{run['id']}/series", params={"name": ["loss", "scale", "skipped"], "rank": rank}
            ).json()
            for rank in (0, 1)
        }
    assert {"grad_norm/0", "grad_norm/2"} <= set(names), names  # per-layer series named as without DDP (no `module.`)
    for rank in (0, 1):
        assert by_rank[rank]["loss"]["steps"] == list(range(steps))
    assert by_rank[0]["loss"]["values"] != by_rank[1]["loss"]["values"]  # each rank's own records
    assert by_rank[0]["scale"]["values"] == by_rank[1]["scale"]["values"]  # found_inf agrees through all-reduce
    assert by_rank[0]["skipped"]["values"][5] == by_rank[1]["skipped"]["values"][5] == 1
    assert _disagreements(sqlite_server, run["id"]) == []  # all-reduced gradients: one found_inf, one scale
    # DDP's replicas: the same parameters, so the same param_norm at every step, bitwise; the server compared them
    assert run["environment"]["parallel"] == "replicated"
    norms = _param_norms(sqlite_server, run["id"])
    assert len(norms[0]) == steps and norms[0] == norms[1]
    assert _desyncs(sqlite_server, run["id"]) == []


def test_a_ddp_rank_whose_parameters_changed_is_named_by_the_server(sqlite_server, tmp_path: Path) -> None:
    [run_id] = _launch(sqlite_server, tmp_path, 12, sync=True, perturb=True)  # rank 1's, before step 8's update
    norms = _param_norms(sqlite_server, run_id)
    assert norms[0][:8] == norms[1][:8] and all(a != b for a, b in zip(norms[0][8:], norms[1][8:]))
    [event] = _desyncs(sqlite_server, run_id)  # once, not at each of the steps 8 to 11
    assert (event["severity"], event["step"], event["rank"]) == ("critical", 8, 1)
    assert (event["details"]["rank"], event["details"]["reference_rank"]) == (1, 0)
    assert event["details"]["param_norm"] == norms[1][8] and event["details"]["reference_param_norm"] == norms[0][8]
    assert "at step 8 rank 1's param_norm is" in event["message"]
    assert _disagreements(sqlite_server, run_id) == []  # (the skipped steps still agree)


def test_ranks_whose_scalers_skip_different_steps_are_told_apart_by_the_server(live_server, tmp_path: Path) -> None:
    # Without DDP each rank's scaler sees its own gradients: only rank 1 overflows at step 5 (rank 0's own data may make
    # it skip another step, as it did at step 4 on one machine: the first step they disagree on is named).
    [run_id] = _launch(live_server, tmp_path, 12, sync=False)
    [event] = _disagreements(live_server, run_id)
    with live_server.client() as http:
        skipped = [
            http.get(f"/api/v1/runs/{run_id}/series", params={"name": "skipped", "rank": r}).json()["skipped"]["values"]
            for r in (0, 1)
        ]
    first = next(step for step, (a, b) in enumerate(zip(*skipped)) if a != b)
    assert first <= 5 and skipped[1][5] == 1
    assert (event["type"], event["severity"], event["step"]) == ("scaler_misuse", "critical", first)
    skipper = 0 if skipped[0][first] else 1
    assert (event["details"]["skipped_by"], event["details"]["kept_by"]) == (skipper, 1 - skipper)
    assert f"rank {skipper} skipped step {first} and rank {1 - skipper} did not" in event["message"]
    assert "ShardedGradScaler" in event["message"]


LIGHTNING_DDP = """
import os, sys, torch, lightning as L
import ampwatch
from ampwatch.lightning import AmpwatchCallback
from lightning.pytorch.plugins import MixedPrecision

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    def training_step(self, batch, batch_idx):
        return self.net(batch).float().pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(256, 16), batch_size=8)

url = os.environ["SERVER"]
callback = AmpwatchCallback(ampwatch.init("lightning-ddp", "early", url=url)) if sys.argv[1] == "early" else \\
    AmpwatchCallback(project="lightning-ddp", name="in-callback", url=url)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=12,
                    plugins=[MixedPrecision("16-mixed", "cpu")], logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[callback])
trainer.fit(Module())
"""


@pytest.mark.parametrize("form", ["in-callback", "early"])
def test_lightning_ddp_ranks_report_into_one_run_when_the_callback_starts_it(
    sqlite_server, tmp_path: Path, form: str
) -> None:
    """Lightning's DDP launcher starts the other ranks itself, after the script's first lines ran: a run started there
    knows no ranks yet (each process reported as rank 0 into a run of its own); one the callback starts at setup
    does."""
    from test_integrations import _series, _stack

    _stack("lightning", "lightning")
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_DDP)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "SERVER": sqlite_server.url}
    done = subprocess.run(
        [sys.executable, str(script), form], capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with sqlite_server.client() as http:
        runs = http.get("/api/v1/runs", params={"project": "lightning-ddp"}).json()
        events = [
            e for r in runs for e in http.get(f"/api/v1/runs/{r['id']}/events").json() if e["type"] == "amp_config"
        ]
    if form == "in-callback":
        [run] = runs
        assert (run["status"], run["environment"]["world_size"], run["last_step"]) == ("finished", 2, 11)
        for rank in (0, 1):
            assert _series(sqlite_server, run["id"], "loss", rank=rank)["loss"]["steps"] == list(range(12))
        assert events == []
    else:  # the mistake is said in each rank's run
        assert len(runs) == 2 and sorted(e["details"]["global_rank"] for e in events) == [0, 1]
        assert all("AmpwatchCallback(project=..., name=...)" in e["message"] for e in events)
