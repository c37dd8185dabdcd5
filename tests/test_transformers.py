"""The Hugging Face Trainer integration with the real `transformers` package: a tiny GPT-2 built from a config,
trained on the CPU, read back through a real server's API."""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

# Read now: an autouse fixture strips AMPWATCH_* variables before each test runs.
REQUIRE_INTEGRATIONS = bool(os.environ.get("AMPWATCH_REQUIRE_INTEGRATIONS"))
VOCAB, CONTEXT = 64, 16


@pytest.fixture
def transformers() -> Iterator[ModuleType]:
    """The real package (skipped without it, a failure when CI requires every integration); Accelerate's
    process-wide singletons are reset after each test so that each Trainer builds its own Accelerator."""
    try:
        module = importlib.import_module("transformers")
    except ImportError as error:
        message = f"transformers is not installed ({error}); `pip install transformers` to test this integration"
        if REQUIRE_INTEGRATIONS:
            pytest.fail(f"{message} (AMPWATCH_REQUIRE_INTEGRATIONS is set)")
        pytest.skip(message)
    yield module
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class _Batches(torch.utils.data.Dataset):
    """Token sequences (their labels are the tokens); `nan_at` rows are fed as embeddings with a NaN in them."""

    served = 0  # samples read so far

    def __init__(self, rows: int, nan_at: frozenset[int] = frozenset(), width: int = 32) -> None:
        generator = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, VOCAB, (rows, CONTEXT), generator=generator)
        self.nan_at, self.width = nan_at, width

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def _model(transformers: ModuleType) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def _args(transformers: ModuleType, tmp_path: Path, precision: str, steps: int, **more: Any) -> Any:
    defaults = {"per_device_train_batch_size": 2, "logging_steps": 1}  # (`more` may change these)
    return transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        max_steps=steps,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **{**defaults, **more},
    )


def _micro_losses(model: torch.nn.Module) -> list[float]:
    """The loss of every training forward, as the model returned it (read here, in the test, with a sync)."""
    losses: list[float] = []

    def keep(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if module.training and torch.is_grad_enabled():
            losses.append(output.loss.item())

    model.register_forward_hook(keep, with_kwargs=True)
    return losses


def _series(server: Any, run_id: str, *names: str) -> dict:
    with server.client() as http:
        reply = http.get(f"/api/v1/runs/{run_id}/series", params=[("name", n) for n in names])
    assert reply.status_code == 200, reply.text
    return reply.json()


def _get(server: Any, path: str) -> Any:
    with server.client() as http:
        reply = http.get(path)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _event_types(server: Any, run_id: str) -> list[str]:
    """The run's event types so far (none while the server does not know the run yet)."""
    with server.client() as http:
        reply = http.get(f"/api/v1/runs/{run_id}/events")
    return [e["type"] for e in reply.json()] if reply.status_code == 200 else []


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_trainer_callback_records_every_optimizer_step_of_an_accumulating_gpt2(
    sqlite_server, transformers: ModuleType, tmp_path: Path, precision: str
) -> None:
    """Without a GradScaler (on the CPU: fp32, bf16, and fp16, which Accelerate trains in fp32) the callback hands
    the agent each micro-batch's loss and the gradient norm before the Trainer clips it."""
    from ampwatch.transformers import AmpwatchCallback

    steps, accumulation = 4, 2
    model = _model(transformers)
    micro = _micro_losses(model)
    callback = AmpwatchCallback(project="transformers", name=f"gpt2-{precision}", url=sqlite_server.url)
    args = _args(transformers, tmp_path, precision, steps, gradient_accumulation_steps=accumulation, max_grad_norm=0.05)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Batches(16), callbacks=[callback])
    trainer.train()

    run = callback.run
    assert run is not None
    data = _series(sqlite_server, run.id, "loss", "grad_norm", "lr", "scale", "skipped")
    for name in ("loss", "grad_norm", "lr"):
        assert data[name]["steps"] == list(range(steps)), name  # one per optimizer step, not per micro-batch
    assert len(micro) == steps * accumulation
    per_step = [math.fsum(micro[i : i + accumulation]) for i in range(0, len(micro), accumulation)]
    assert data["loss"]["values"] == pytest.approx(per_step, rel=1e-6)  # the micro-batches add up
    logged = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    assert data["loss"]["values"] == pytest.approx([e["loss"] for e in logged], abs=1e-4)  # (the Trainer rounds)
    norms = [e["grad_norm"] for e in logged]
    assert data["grad_norm"]["values"] == pytest.approx(norms, rel=1e-5) and min(norms) > 0.05  # before the clip
    assert data["lr"]["values"] == pytest.approx([e["learning_rate"] for e in logged], rel=1e-6)
    assert data["scale"] == {"steps": [], "values": []}  # no GradScaler on the CPU
    layers = [n for n in _get(sqlite_server, f"/api/v1/runs/{run.id}")["series"] if n.startswith("grad_norm/")]
    assert any(".h.0." in n for n in layers) and any(".h.1." in n for n in layers), layers  # per-layer norms
    squares = _series(sqlite_server, run.id, *layers)
    total = math.sqrt(math.fsum(s["values"][s["steps"].index(0)] ** 2 for s in squares.values() if 0 in s["steps"]))
    assert total == pytest.approx(norms[0], rel=1e-4)  # the layers' norms partition the step's norm
    info = _get(sqlite_server, f"/api/v1/runs/{run.id}")
    assert info["status"] == "finished"
    assert info["config"]["gradient_accumulation_steps"] == accumulation and info["config"]["bf16"] is (
        precision == "bf16"
    )  # the run's config is the TrainingArguments
    checks = [e["details"].get("check") for e in _get(sqlite_server, f"/api/v1/runs/{run.id}/events")]
    assert checks == (["accelerate_fp16_on_cpu"] if precision == "fp16" else [])  # fp16 on the CPU is fp32: said


class _Embedded(_Batches):
    """The same sequences fed as embeddings (`inputs_embeds`): the samples served `nan_at` (counted from 0, in
    the order the training reads them) carry one NaN, as a corrupt sample of real data would."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        embeds = torch.nn.functional.one_hot(self.tokens[i] % self.width, self.width).float()
        if self.served in self.nan_at:
            embeds[3, 5] = float("nan")
        self.served += 1
        return {"inputs_embeds": embeds, "labels": self.tokens[i] % self.width}


class _Regression(torch.nn.Module):
    """The smallest model a Trainer trains (the loss in its output, as the Trainer expects): a healthy loop's cost is
    the Trainer's own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x).float(), labels)}


class _Noisy(torch.utils.data.Dataset):
    def __init__(self, rows: int) -> None:
        generator = torch.Generator().manual_seed(2)
        self.x = torch.randn(rows, 16, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.x[i, :1].sin()}


BUDGET_STEPS = 2000  # (a few thousand optimizer steps: the false-warning budget of each integration's loop)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_healthy_training_gets_no_warning_and_no_alert(
    sqlite_server, transformers: ModuleType, tmp_path: Path, precision: str
) -> None:
    """The false-warning budget, zero: a few thousand healthy optimizer steps through the callback, batches of 4, the
    Trainer's clipping and its warm-up and cosine schedule. On the CPU, fp16 is trained in fp32 by Accelerate (no
    GradScaler, no autocast): its one warning is that, which is true; nothing else may warn."""
    from ampwatch.transformers import AmpwatchCallback

    callback = AmpwatchCallback(project="budget", name=f"trainer-{precision}", url=sqlite_server.url)
    args = _args(
        transformers,
        tmp_path,
        precision,
        BUDGET_STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=100,
        logging_steps=100,
    )
    trainer = transformers.Trainer(model=_Regression(), args=args, train_dataset=_Noisy(4096), callbacks=[callback])
    trainer.train()
    run = callback.run
    assert run is not None
    with sqlite_server.client() as http:
        stored = http.get(f"/api/v1/runs/{run.id}").json()
        events = http.get(f"/api/v1/runs/{run.id}/events").json()
        alerts = http.get("/api/v1/alerts", params={"run_id": run.id}).json()
    assert (stored["status"], stored["last_step"]) == ("finished", BUDGET_STEPS - 1)
    warnings = [(e["type"], e["details"].get("check"), e["step"]) for e in events if e["severity"] != "info"]
    true_ones = [("amp_config", "accelerate_fp16_on_cpu", 0)] if precision == "fp16" else []
    assert (warnings, alerts) == (true_ones, []), [e["message"] for e in events if e["severity"] != "info"]
    assert stored["health"] == ("warning" if true_ones else "ok")


def test_trainer_callback_records_a_nan_batch_that_the_trainers_own_logs_hide(
    sqlite_server, transformers: ModuleType, tmp_path: Path, wait_for
) -> None:
    """`logging_nan_inf_filter` (on by default) logs a NaN step's loss as the running average; the run has it as
    NaN, told as a critical nonfinite_loss, and the NaN-origin probe names where the next NaN forward starts."""
    from ampwatch.transformers import AmpwatchCallback

    class Pause(transformers.TrainerCallback):
        """After the NaN step (3), until the server has its event: the sender has diagnosed it and armed the probe
        (a loop this fast would otherwise end first)."""

        def on_log(self, args: Any, state: Any, control: Any, logs: dict, **kwargs: Any) -> None:
            if state.global_step == 4:
                wait_for(lambda: "nonfinite_loss" in _event_types(sqlite_server, callback.run.id), what="the NaN event")

    steps = 10
    callback = AmpwatchCallback(project="transformers", name="gpt2-nan", url=sqlite_server.url)
    dataset = _Embedded(steps * 2, nan_at=frozenset({7}))  # (batches of 2: step 3)
    trainer = transformers.Trainer(
        model=_model(transformers),
        args=_args(transformers, tmp_path, "bf16", steps),
        train_dataset=dataset,
        callbacks=[callback, Pause()],
    )
    trainer.train()

    run = callback.run
    assert run is not None
    logged = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    bad = 3
    assert [math.isnan(entry["grad_norm"]) for entry in logged] == [False] * bad + [True] * (steps - bad)
    assert logged[bad]["loss"] == 0.0  # what the Trainer's own log says of the NaN step
    loss = _series(sqlite_server, run.id, "loss")["loss"]
    assert loss["steps"] == list(range(steps))
    assert loss["values"][:bad] == pytest.approx([e["loss"] for e in logged[:bad]], abs=1e-4)
    assert loss["values"][bad] == "NaN"  # stored and shown exactly
    events = _get(sqlite_server, f"/api/v1/runs/{run.id}/events")
    first = next(e for e in events if e["type"] == "nonfinite_loss")
    assert (first["step"], first["severity"], first["details"]["loss"]) == (bad, "critical", "NaN")
    assert "There is no GradScaler to skip the step" in first["message"]
    [origin] = [e for e in events if "origin" in e["details"]]
    # bf16 without a GradScaler: the optimizer wrote the NaN gradients into the weights, so the next forward's first
    # non-finite output is the first module's, and the probe says the parameters made it.
    assert origin["step"] > bad and (origin["details"]["origin"], origin["details"]["phase"]) == (
        "transformer.wpe",
        "forward",
    )
    assert "its parameters are non-finite" in origin["message"]
    assert _get(sqlite_server, f"/api/v1/runs/{run.id}")["status"] == "finished"


def test_a_learning_rate_that_runs_away_is_a_grad_spike_before_the_nan(
    sqlite_server, transformers: ModuleType, tmp_path: Path
) -> None:
    """A schedule bug: from step 24 the learning rate grows tenfold per step. The gradient norm leaves its range a
    few steps before the loss turns NaN, and the run says so in that order."""
    from ampwatch.transformers import AmpwatchCallback

    steps, ramp = 36, 24
    model = _model(transformers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 if s < ramp else 10.0 ** (s - ramp + 1))
    callback = AmpwatchCallback(project="transformers", name="gpt2-lr", url=sqlite_server.url)
    trainer = transformers.Trainer(
        model=model,
        args=_args(transformers, tmp_path, "bf16", steps),
        train_dataset=_Batches(steps * 2),
        optimizers=(optimizer, schedule),
        callbacks=[callback],
    )
    trainer.train()

    run = callback.run
    assert run is not None
    logged = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    nan = next(step for step, entry in enumerate(logged) if math.isnan(entry["grad_norm"]))
    lr = _series(sqlite_server, run.id, "lr")["lr"]
    assert lr["values"] == pytest.approx([e["learning_rate"] for e in logged], rel=1e-6)
    events = _get(sqlite_server, f"/api/v1/runs/{run.id}/events")
    spikes = [e for e in events if e["type"] == "grad_spike"]
    told_nan = [e for e in events if e["type"] == "nonfinite_loss"]
    assert spikes and told_nan, [(e["step"], e["type"]) for e in events]
    assert ramp < spikes[0]["step"] < told_nan[0]["step"] == nan  # the spike is told first, steps before the NaN
    assert not [e for e in events if e["step"] <= ramp and e["severity"] != "info"]  # quiet before the ramp


def test_a_training_resumed_from_its_checkpoint_continues_the_runs_steps(
    sqlite_server, transformers: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`trainer.train(resume_from_checkpoint=...)` under the same run id: the second launch's steps follow the first's
    (the Trainer's restored global step), nothing stored is overwritten, and where it resumed is an event."""
    from ampwatch.transformers import AmpwatchCallback

    monkeypatch.setenv("AMPWATCH_RUN_ID", "hf-resumed")
    first = _args(transformers, tmp_path, "fp32", 4)
    first.save_strategy, first.save_steps = "steps", 4
    trainer = transformers.Trainer(
        model=_model(transformers),
        args=first,
        train_dataset=_Batches(32),
        callbacks=[AmpwatchCallback(project="transformers", name="resumed", url=sqlite_server.url)],
    )
    trainer.train()
    again = _args(transformers, tmp_path, "fp32", 7)
    resumed = transformers.Trainer(
        model=_model(transformers),
        args=again,
        train_dataset=_Batches(32),
        callbacks=[AmpwatchCallback(project="transformers", name="resumed", url=sqlite_server.url)],
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))

    data = _series(sqlite_server, "hf-resumed", "loss", "grad_norm")
    assert data["loss"]["steps"] == list(range(7)) and data["grad_norm"]["steps"] == list(range(7))
    events = _get(sqlite_server, "/api/v1/runs/hf-resumed/events")
    saved = str(tmp_path / "out" / "checkpoint-4")
    assert [(e["step"], e["type"], e["details"].get("check") or e["details"].get("path")) for e in events] == [
        (4, "checkpoint", saved),  # (the first launch's checkpoint, recorded by the callback's on_save)
        (4, "amp_config", "resumed"),
    ]
    assert _get(sqlite_server, "/api/v1/runs/hf-resumed/plan")["trouble"] is None  # (a healthy run: nothing to undo)
    assert _get(sqlite_server, "/api/v1/runs/hf-resumed")["status"] == "finished"


def test_a_callback_added_later_watches_a_run_of_yours_and_can_leave_it_open(
    sqlite_server, transformers: ModuleType, tmp_path: Path, wait_for
) -> None:
    """`trainer.add_callback()` after the Trainer is built (no on_init_end): the Trainer is found at on_train_begin."""
    import ampwatch
    from ampwatch.transformers import AmpwatchCallback

    def last_step_and_status() -> tuple | None:
        with sqlite_server.client() as http:
            reply = http.get(f"/api/v1/runs/{run.id}")
        return (reply.json()["last_step"], reply.json()["status"]) if reply.status_code == 200 else None

    with ampwatch.init(project="transformers", name="gpt2-open", url=sqlite_server.url) as run:
        trainer = transformers.Trainer(
            model=_model(transformers), args=_args(transformers, tmp_path, "bf16", 3), train_dataset=_Batches(6)
        )
        trainer.add_callback(AmpwatchCallback(run, finish=False))
        trainer.train()
        assert wait_for(lambda: last_step_and_status() == (2, "running"), what="the training's last step") is True
        run.log({"eval_loss": 3.5}, step=2)
    data = _series(sqlite_server, run.id, "loss", "eval_loss")
    assert data["loss"]["steps"] == [0, 1, 2] and data["eval_loss"] == {"steps": [2], "values": [3.5]}
    assert _get(sqlite_server, f"/api/v1/runs/{run.id}")["status"] == "finished"


def test_a_run_asked_to_stop_ends_the_trainers_training_and_ends_stopped(
    sqlite_server, transformers: ModuleType, tmp_path: Path
) -> None:
    """A stop asked of a run of yours before `train()`: the agent learns it at its first exchange, the callback sets
    `control.should_training_stop`, the training ends after that step, and the run ends `stopped`."""
    import httpx

    import ampwatch
    from ampwatch.transformers import AmpwatchCallback

    max_steps = 200
    run = ampwatch.init(project="transformers", name="gpt2-stop", url=sqlite_server.url)
    assert run.flush()  # (registered: there is a run to stop)
    httpx.post(
        f"{sqlite_server.url}/api/v1/runs/{run.id}/stop", json={"reason": "bad data"}, timeout=30
    ).raise_for_status()
    trainer = transformers.Trainer(
        model=_model(transformers),
        args=_args(transformers, tmp_path, "fp32", max_steps),
        train_dataset=_Batches(2 * max_steps),
        callbacks=[AmpwatchCallback(run)],
    )
    trainer.train()
    assert 0 < trainer.state.global_step < max_steps
    shown = _get(sqlite_server, f"/api/v1/runs/{run.id}")
    assert shown["status"] == "stopped" and shown["stop"]["reason"] == "bad data"
    assert _series(sqlite_server, run.id, "loss")["loss"]["steps"] == list(range(trainer.state.global_step))


def test_trainer_callback_marks_the_run_crashed_and_lets_the_exception_through(
    sqlite_server, transformers: ModuleType, tmp_path: Path
) -> None:
    from ampwatch.transformers import AmpwatchCallback

    class Broken(_Batches):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            if self.served == 6:
                raise RuntimeError("the data loader returned garbage")
            self.served += 1
            return super().__getitem__(i)

    dataset = Broken(32)
    callback = AmpwatchCallback(project="transformers", name="gpt2-crash", url=sqlite_server.url)
    trainer = transformers.Trainer(
        model=_model(transformers),
        args=_args(transformers, tmp_path, "bf16", 10),
        train_dataset=dataset,
        callbacks=[callback],
    )
    with pytest.raises(RuntimeError, match="data loader returned garbage"):
        trainer.train()

    run = callback.run
    assert run is not None
    assert _get(sqlite_server, f"/api/v1/runs/{run.id}")["status"] == "crashed"
    crashed = [e for e in _get(sqlite_server, f"/api/v1/runs/{run.id}/events") if e["type"] == "run_crashed"]
    assert len(crashed) == 1 and "data loader returned garbage" in crashed[0]["message"]
    # (Accelerate's loader reads a batch ahead: the 4th batch's sample fails while step 2 is being fetched)
    assert crashed[0]["step"] >= 2 and _series(sqlite_server, run.id, "loss")["loss"]["steps"] == list(
        range(crashed[0]["step"])
    )
    assert "training_step" not in vars(trainer)  # the Trainer has its own method back


def test_a_misspelt_argument_fails_when_the_callback_is_built(
    transformers: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ampwatch
    from ampwatch.transformers import AmpwatchCallback

    with pytest.raises(TypeError, match="projekt"):
        AmpwatchCallback(projekt="llm")
    with pytest.raises(TypeError, match="not both"):
        monkeypatch.setenv("AMPWATCH_MODE", "disabled")  # (a run that records nothing: no sender left behind)
        AmpwatchCallback(ampwatch.init(project="x"), name="y")


def test_the_documented_example_records_its_run(
    sqlite_server, transformers: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The complete example of docs/integrations/transformers.md, run as written (the server from AMPWATCH_URL)."""
    page = (Path(__file__).parent.parent / "docs" / "integrations" / "transformers.md").read_text()
    example = next(block for block in page.split("```python\n")[1:] if "trainer.train()" in block).split("```")[0]
    monkeypatch.setenv("AMPWATCH_URL", sqlite_server.url)
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "transformers.md", "exec"), {})
    with sqlite_server.client() as http:
        [run] = http.get("/api/v1/runs", params={"project": "gpt2"}).json()
    assert (run["name"], run["status"], run["last_step"]) == ("tiny-bf16", "finished", 7)
    assert _series(sqlite_server, run["id"], "loss")["loss"]["steps"] == list(range(8))


def test_importing_ampwatch_loads_neither_transformers_nor_deepspeed(tmp_path: Path) -> None:
    modules = ("ampwatch.transformers", "transformers", "ampwatch.deepspeed", "deepspeed")
    code = f"import sys, ampwatch; print([m for m in {modules!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr


DDP = """
import os, sys, torch, transformers
from ampwatch.transformers import AmpwatchCallback

sys.path.insert(0, TESTS)
from test_transformers import _Batches, _args, _model

args = _args(transformers, __import__("pathlib").Path(OUT), "bf16", STEPS, ddp_backend="gloo")
callback = AmpwatchCallback(project="transformers-ddp", name="two-ranks", url=os.environ["SERVER"])
trainer = transformers.Trainer(model=_model(transformers), args=args, train_dataset=_Batches(STEPS * 4),
                               callbacks=[callback])
trainer.train()
print(f"rank {args.process_index} run {callback.run.id}\\n", end="", flush=True)  # (one write: a shared pipe)
"""


def test_trainer_callback_under_torchrun_reports_every_rank_into_one_run(
    sqlite_server, transformers: ModuleType, tmp_path: Path
) -> None:
    """The process group exists when the training begins: every rank derives the same run id and reports its own
    records under its rank."""
    steps = 4
    script = tmp_path / "train.py"
    tests = str(Path(__file__).parent)
    script.write_text(
        DDP.replace("TESTS", repr(tests)).replace("OUT", repr(str(tmp_path))).replace("STEPS", str(steps))
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    env = {
        "SERVER": sqlite_server.url,
        "PATH": "/usr/bin:/bin",
        "OMP_NUM_THREADS": "1",
        "HOME": str(tmp_path),
        "HF_HUB_OFFLINE": "1",
        "AMPWATCH_FLUSH_INTERVAL_S": "0.05",
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = {line.split()[-1] for line in done.stdout.splitlines() if line.startswith("rank")}
    with sqlite_server.client() as http:
        runs = http.get("/api/v1/runs", params={"project": "transformers-ddp"}).json()
        assert [r["id"] for r in runs] == list(ids) and len(ids) == 1  # both ranks chose the same run id
        run = http.get(f"/api/v1/runs/{runs[0]['id']}").json()
        by_rank = [
            http.get(f"/api/v1/runs/{run['id']}/series", params={"name": ["loss", "grad_norm"], "rank": rank}).json()
            for rank in (0, 1)
        ]
    assert (run["status"], run["environment"]["world_size"], run["last_step"]) == ("finished", 2, steps - 1)
    assert "grad_norm/transformer.h.0.mlp.c_fc" in run["series"], run["series"]  # named as without DDP
    for data in by_rank:
        assert data["loss"]["steps"] == data["grad_norm"]["steps"] == list(range(steps))
    assert by_rank[0]["loss"]["values"] != by_rank[1]["loss"]["values"]  # each rank's own batches
    assert by_rank[0]["grad_norm"]["values"] == pytest.approx(
        by_rank[1]["grad_norm"]["values"], rel=1e-6
    )  # all-reduced
