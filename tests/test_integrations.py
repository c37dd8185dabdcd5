"""The three-line attachment in popular stacks, with real CPU training read back through the API:
nanoGPT's loop, HF Accelerate and PyTorch Lightning."""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

import ampwatch

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # inside Lightning 2.6, not ours

# Read now: an autouse fixture strips AMPWATCH_* variables before each test runs.
REQUIRE_INTEGRATIONS = bool(os.environ.get("AMPWATCH_REQUIRE_INTEGRATIONS"))


def _stack(module: str, install: str) -> ModuleType:
    """Import a training stack; skip without it, or fail when CI requires every integration."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        message = f"{module} is not installed ({error}); `pip install {install}` to test this integration"
        if REQUIRE_INTEGRATIONS:
            pytest.fail(f"{message} (AMPWATCH_REQUIRE_INTEGRATIONS is set)")
        pytest.skip(message)


def _series(server, run_id: str, *names: str, rank: int = 0) -> dict:
    with server.client() as http:
        reply = http.get(f"/api/v1/runs/{run_id}/series", params=[("name", n) for n in names] + [("rank", rank)])
    assert reply.status_code == 200, reply.text
    return reply.json()


def _run_info(server, run_id: str) -> dict:
    with server.client() as http:
        reply = http.get(f"/api/v1/runs/{run_id}")
    assert reply.status_code == 200, reply.text
    return reply.json()


def _total_norm(parameters: Iterator[torch.nn.Parameter]) -> float:
    return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None]).item()


def _layer_norms_add_up(data: dict, step: int, total: float) -> None:
    """The per-module series at `step` are a partition of the total gradient norm."""
    layers = [name for name in data if name.startswith("grad_norm/")]
    assert len(layers) >= 2, sorted(data)
    squares = sum(data[n]["values"][data[n]["steps"].index(step)] ** 2 for n in layers)
    assert math.sqrt(squares) == pytest.approx(total, rel=1e-4)


# -- nanoGPT ---------------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.c_attn, self.c_proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp(self.ln_2(x))


class _GPT(torch.nn.Module):
    """nanoGPT's model in miniature: tied embeddings, pre-norm causal blocks, (logits, loss) out."""

    def __init__(self, vocab: int = 32, block: int = 16, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(block, dim)
        self.h = torch.nn.ModuleList(_Block(dim, 4) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))

    def configure_optimizers(self, weight_decay: float, learning_rate: float) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95), fused=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_nanogpt_loop_records_every_optimizer_step_with_accumulated_loss(sqlite_server, dtype: str) -> None:
    """train.py's loop as written: fused AdamW, a scaler disabled under bf16, accumulation, unscale_ + clip."""
    torch.manual_seed(0)
    iters, gradient_accumulation_steps, grad_clip = 8, 3, 1.0
    model = _GPT()
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=(dtype == "float16"))
    ctx = torch.autocast("cpu", dtype=getattr(torch, dtype))
    data = torch.randint(0, 32, (4096,))

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(data) - 16, (4,))
        return torch.stack([data[i : i + 16] for i in ix]), torch.stack([data[i + 1 : i + 17] for i in ix])

    run = ampwatch.init(project="integrations", name=f"nanogpt-{dtype}", url=sqlite_server.url)
    run.watch(model=model, optimizer=optimizer, scaler=scaler)
    expected_loss, expected_norm, scales = [], [], []
    X, Y = get_batch()
    for iter_num in range(iters):
        for param_group in optimizer.param_groups:
            param_group["lr"] = 1e-3 * (iter_num + 1) / iters  # nanoGPT's warmup sets lr by hand
        micro_losses = []
        for _micro_step in range(gradient_accumulation_steps):
            with ctx:
                _logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            micro_losses.append(loss.item())
            X, Y = get_batch()
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        expected_norm.append(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).item())
        scales.append(scaler.get_scale() if scaler.is_enabled() else None)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        expected_loss.append(math.fsum(micro_losses))
    run.finish()

    layers = [n for n in _run_info(sqlite_server, run.id)["series"] if n.startswith("grad_norm/")]
    data = _series(sqlite_server, run.id, "loss", "grad_norm", "lr", "scale", "skipped", *layers)
    for name in ("loss", "grad_norm", "lr"):
        assert data[name]["steps"] == list(range(iters)), name
    assert data["loss"]["values"] == pytest.approx(expected_loss, rel=1e-5)  # the micro-batch losses, summed
    assert data["grad_norm"]["values"] == pytest.approx(expected_norm, rel=1e-4)  # unscaled, before clipping
    assert data["lr"]["values"] == pytest.approx([1e-3 * (i + 1) / iters for i in range(iters)])
    _layer_norms_add_up(data, 0, expected_norm[0])
    if dtype == "float16":
        assert data["scale"] == {"steps": list(range(iters)), "values": scales}
        scales_after = [*scales[1:], scaler.get_scale()]
        assert data["skipped"]["values"] == [int(after < before) for before, after in zip(scales, scales_after)]
    else:  # a disabled scaler has no scale: steps are counted through the fused optimizer's hooks
        assert data["scale"] == data["skipped"] == {"steps": [], "values": []}
    assert [_run_info(sqlite_server, run.id)[k] for k in ("status", "health")] == ["finished", "ok"]  # (no warning)


# -- HF Accelerate ---------------------------------------------------------------------------------


@pytest.fixture
def accelerate() -> Iterator[ModuleType]:
    """Accelerate keeps process-wide singletons: reset them so each test builds its own Accelerator."""
    module = _stack("accelerate", "accelerate")
    from accelerate.state import AcceleratorState, GradientState

    yield module
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.mark.parametrize("mixed_precision", ["bf16", "fp16"])
def test_accelerate_loop_records_every_optimizer_step_through_the_wrapped_optimizer(
    sqlite_server, accelerate: ModuleType, mixed_precision: str
) -> None:
    """`optimizer` after `prepare()` is an AcceleratedOptimizer whose own step hooks never fire; the agent
    hooks the optimizer inside it. On CPU Accelerate builds no GradScaler: bf16 autocasts, fp16 trains in fp32."""
    torch.manual_seed(0)
    steps, accumulation = 6, 2
    accelerator = accelerate.Accelerator(
        mixed_precision=mixed_precision, cpu=True, gradient_accumulation_steps=accumulation
    )
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(torch.randn(steps * accumulation * 4, 16), batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    run = ampwatch.init(project="integrations", name=f"accelerate-{mixed_precision}", url=sqlite_server.url)
    run.watch(model=model, optimizer=optimizer, scaler=accelerator.scaler)
    expected_loss, expected_norm, scales = [], [], []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(batch).float().pow(2).mean()
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                run.log({"loss": loss})  # no scaler under bf16 on CPU: the agent cannot see the loss by itself
                scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else None
                expected_loss.append(loss.item())
                expected_norm.append(_total_norm(model.parameters()) / (scale or 1.0))
                scales.append(scale)
                accelerator.clip_grad_norm_(
                    model.parameters(), 1e-3
                )  # the norm before it is recorded, with or without a scaler
            optimizer.step()
            optimizer.zero_grad()
    run.finish()

    data = _series(sqlite_server, run.id, "loss", "grad_norm", "lr", "scale")
    for name in ("loss", "grad_norm", "lr"):
        assert data[name]["steps"] == list(range(steps)), name  # one step per real optimizer step, not per batch
    assert data["loss"]["values"] == pytest.approx(expected_loss, rel=1e-6)
    assert data["grad_norm"]["values"] == pytest.approx(expected_norm, rel=1e-5)  # the accumulated gradients
    if accelerator.scaler is None:
        assert data["scale"] == {"steps": [], "values": []}
    else:  # fp16 where Accelerate builds a scaler (GPUs): its scale is recorded too
        assert data["scale"]["values"] == scales
    assert _run_info(sqlite_server, run.id)["status"] == "finished"
    with sqlite_server.client() as http:
        checks = [
            e["details"].get("check")
            for e in http.get(f"/api/v1/runs/{run.id}/events").json()
            if e["type"] == "amp_config"
        ]
    # Accelerate turns fp16 on the CPU into plain fp32 without a word: the agent says it.
    fp32_in_disguise = mixed_precision == "fp16" and accelerator.scaler is None
    assert checks == (["accelerate_fp16_on_cpu"] if fp32_in_disguise else [])


# -- PyTorch Lightning -----------------------------------------------------------------------------


@pytest.fixture
def lightning() -> ModuleType:
    return _stack("lightning", "lightning")


def _lightning_module(L: ModuleType, fail_at: int | None = None) -> object:
    class Regression(L.LightningModule):
        """Records, from Lightning's own hooks, the values the agent must report."""

        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
            self.backward_losses: list[float] = []
            self.norms: list[float] = []
            self.scales: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if batch_idx == fail_at:
                raise RuntimeError("data loader returned garbage")
            return self.net(batch).float().pow(2).mean()

        def on_before_backward(self, loss: torch.Tensor) -> None:
            # Divided by accumulate_grad_batches, and already scaled when the plugin has a GradScaler.
            scaler = self.trainer.precision_plugin.scaler
            self.backward_losses.append(loss.item() / (scaler.get_scale() if scaler is not None else 1.0))

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            self.norms.append(_total_norm(self.parameters()))  # after unscale_, before Lightning clips
            scaler = self.trainer.precision_plugin.scaler
            self.scales.append(scaler.get_scale() if scaler is not None else None)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.randn(256, 16), batch_size=8)

    return Regression()


def _trainer(L: ModuleType, callback: object, steps: int, precision: str, accumulation: int) -> object:
    from lightning.pytorch.plugins import MixedPrecision

    # On CPU, precision="16-mixed" silently falls back to bf16; the plugin is how fp16 AMP with a GradScaler runs here.
    amp = {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=accumulation,
        gradient_clip_val=0.05,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **amp,
    )


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_lightning_callback_records_every_optimizer_step_and_finishes_the_run(
    sqlite_server, lightning: ModuleType, precision: str
) -> None:
    """bf16: no scaler; Lightning computes the gradients inside `optimizer.step(closure)`, so the norm is taken
    once the closure's backward ran. fp16: the precision plugin's GradScaler is watched like any other."""
    from ampwatch.lightning import AmpwatchCallback

    steps, accumulation = 6, 2
    module = _lightning_module(lightning)
    run = ampwatch.init(project="integrations", name=f"lightning-{precision}", url=sqlite_server.url)
    trainer = _trainer(lightning, AmpwatchCallback(run), steps, precision, accumulation)
    trainer.fit(module)

    data = _series(
        sqlite_server, run.id, "loss", "grad_norm", "lr", "scale", "skipped", "grad_norm/net.0", "grad_norm/net.2"
    )
    for name in ("loss", "grad_norm", "lr"):
        assert data[name]["steps"] == list(range(steps)), name
    micro = module.backward_losses
    assert len(micro) == steps * accumulation
    per_step = [math.fsum(micro[i : i + accumulation]) for i in range(0, len(micro), accumulation)]
    assert data["loss"]["values"] == pytest.approx(per_step, rel=1e-5)  # the accumulated micro-batches add up
    assert data["grad_norm"]["values"] == pytest.approx(module.norms, rel=1e-4)  # unscaled, before clipping to 0.05
    assert min(module.norms) > 0.05  # so clipping did change the gradients the agent must not see
    _layer_norms_add_up(data, 0, module.norms[0])
    if precision == "16-mixed":
        assert data["scale"]["values"] == module.scales and data["skipped"]["steps"] == list(range(steps))
    else:
        assert trainer.precision_plugin.scaler is None and data["scale"] == {"steps": [], "values": []}
    assert [_run_info(sqlite_server, run.id)[k] for k in ("status", "health")] == ["finished", "ok"]  # (finish() ran)


BUDGET_STEPS = 2000  # (a few thousand optimizer steps: the false-warning budget of each integration's loop)


def _healthy(server, run_id: str, steps: int) -> tuple[list[tuple[str, int, str]], list[dict], str]:
    """A finished run's warnings and criticals (type, step, message), its alerts, and its health."""
    with server.client() as http:
        run = http.get(f"/api/v1/runs/{run_id}").json()
        events = http.get(f"/api/v1/runs/{run_id}/events").json()
        alerts = http.get("/api/v1/alerts", params={"run_id": run_id}).json()
    assert (run["status"], run["last_step"]) == ("finished", steps - 1), run
    return [(e["type"], e["step"], e["message"]) for e in events if e["severity"] != "info"], alerts, run["health"]


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_a_healthy_lightning_fit_gets_no_warning_and_no_alert(
    sqlite_server, lightning: ModuleType, precision: str
) -> None:
    """The false-warning budget, zero: a healthy fit of a few thousand steps through the callback, noisy batches of
    4, clipping (to 0.05), a cosine LR scheduler that Lightning steps every step; fp16 with the plugin's GradScaler (its
    start-up skip and occasional overflow skips included), bf16 without one."""
    from ampwatch.lightning import AmpwatchCallback

    class Healthy(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.net(x).float(), x[:, :1].sin())

        def configure_optimizers(self) -> dict:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
            cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=BUDGET_STEPS)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.randn(4096, 16), batch_size=4, shuffle=True)

    callback = AmpwatchCallback(project="budget", name=f"lightning-{precision}", url=sqlite_server.url)
    trainer = _trainer(lightning, callback, BUDGET_STEPS, precision, 1)
    trainer.fit(Healthy())
    assert (trainer.precision_plugin.scaler is not None) == (precision == "16-mixed")
    warnings, alerts, health = _healthy(sqlite_server, callback.run.id, BUDGET_STEPS)
    assert (warnings, alerts, health) == ([], [], "ok")


def test_lightning_callback_marks_the_run_crashed_and_lets_the_exception_through(
    sqlite_server, lightning: ModuleType
) -> None:
    from ampwatch.lightning import AmpwatchCallback

    run = ampwatch.init(project="integrations", name="lightning-crash", url=sqlite_server.url)
    trainer = _trainer(lightning, AmpwatchCallback(run), 10, "bf16-mixed", 1)
    with pytest.raises(RuntimeError, match="data loader returned garbage"):
        trainer.fit(_lightning_module(lightning, fail_at=3))

    assert _run_info(sqlite_server, run.id)["status"] == "crashed"
    with sqlite_server.client() as http:
        events = http.get(f"/api/v1/runs/{run.id}/events").json()
    crashed = [e for e in events if e["type"] == "run_crashed"]
    assert len(crashed) == 1 and crashed[0]["step"] == 3 and "data loader returned garbage" in crashed[0]["message"]
    assert _series(sqlite_server, run.id, "loss")["loss"]["steps"] == [0, 1, 2]


def test_lightning_callback_can_leave_the_run_open(sqlite_server, lightning: ModuleType, wait_for) -> None:
    from ampwatch.lightning import AmpwatchCallback

    def last_step_and_status() -> tuple | None:
        with sqlite_server.client() as http:
            reply = http.get(f"/api/v1/runs/{run.id}")
        return (reply.json()["last_step"], reply.json()["status"]) if reply.status_code == 200 else None

    with ampwatch.init(project="integrations", name="lightning-open", url=sqlite_server.url) as run:
        _trainer(lightning, AmpwatchCallback(run, finish=False), 3, "bf16-mixed", 1).fit(_lightning_module(lightning))
        assert wait_for(lambda: last_step_and_status() == (2, "running"), what="the fit's last step") is True
        run.log({"val_loss": 0.5}, step=2)
    assert _series(sqlite_server, run.id, "val_loss")["val_loss"] == {"steps": [2], "values": [0.5]}
    assert _run_info(sqlite_server, run.id)["status"] == "finished"


def test_importing_ampwatch_loads_no_integration(tmp_path) -> None:
    modules = ("ampwatch.lightning", "lightning", "pytorch_lightning", "accelerate")
    code = f"import sys, ampwatch; print([m for m in {modules!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr


def test_lightning_gan_without_a_scaler_records_the_first_optimizers_steps_only(
    sqlite_server, lightning: ModuleType
) -> None:
    """Manual optimization, a generator's step then a discriminator's, bf16: the steps and norms are the generator's
    (the first optimizer's); the discriminator's norm and loss were added to the next step."""
    from ampwatch.lightning import AmpwatchCallback

    class GAN(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.g = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))
            self.d = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
            self.g_norms: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            g_opt, d_opt = self.optimizers()
            z = torch.randn(4, 8)
            g_opt.zero_grad()
            self.manual_backward(-self.d(self.g(z)).float().mean())
            self.g_norms.append(_total_norm(self.g.parameters()))
            g_opt.step()
            d_opt.zero_grad()
            self.manual_backward(self.d(self.g(z).detach()).float().mean() - self.d(batch).float().mean())
            d_opt.step()

        def configure_optimizers(self) -> list[torch.optim.Optimizer]:
            return [torch.optim.SGD(self.g.parameters(), lr=0.01), torch.optim.SGD(self.d.parameters(), lr=0.02)]

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(torch.randn(24, 16), batch_size=4)

    torch.manual_seed(0)
    module = GAN()
    run = ampwatch.init(project="integrations", name="lightning-gan", url=sqlite_server.url)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[AmpwatchCallback(run)],
    )
    trainer.fit(module)
    data = _series(sqlite_server, run.id, "loss", "grad_norm")
    assert data["grad_norm"]["steps"] == list(range(6))
    assert data["grad_norm"]["values"] == pytest.approx(module.g_norms, rel=1e-4)
    assert data["loss"] == {"steps": [], "values": []}  # (whose backward is whose: unknown with two optimizers; log it)


def test_lightning_callback_records_the_checkpoints_the_trainer_saves_and_stops_the_fit_when_asked(
    sqlite_server, lightning: ModuleType, tmp_path
) -> None:
    """ModelCheckpoint every 5 steps: each checkpoint is a `checkpoint` event at its step with the file's path. An
    admin's stop mid-fit ends the fit after a batch (trainer.should_stop), and the run ends `stopped`."""
    import httpx
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from ampwatch.lightning import AmpwatchCallback

    max_steps, ask_at = 400, 8

    class AskToStop(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            if trainer.global_step == ask_at:
                assert run.flush()  # (the run is registered)
                url = f"{sqlite_server.url}/api/v1/runs/{run.id}/stop"
                httpx.post(url, json={"reason": "enough"}, timeout=30).raise_for_status()

    folder = tmp_path / "ckpt"
    saved = ModelCheckpoint(dirpath=folder, every_n_train_steps=5, save_top_k=-1, filename="{step}")
    run = ampwatch.init(project="integrations", name="lightning-stop", url=sqlite_server.url)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        precision="bf16-mixed",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[AmpwatchCallback(run), saved, AskToStop()],
    )
    trainer.fit(_lightning_module(lightning))

    assert ask_at < trainer.global_step < max_steps  # the fit stopped early, once the agent learned of the stop
    info = _run_info(sqlite_server, run.id)
    assert info["status"] == "stopped" and info["stop"]["reason"] == "enough"
    with sqlite_server.client() as http:
        events = http.get(f"/api/v1/runs/{run.id}/events").json()
    checkpoints = [(e["step"], e["details"]["path"]) for e in events if e["type"] == "checkpoint"]
    expected = [(s, str(folder / f"step={s}.ckpt")) for s in range(5, trainer.global_step + 1, 5)]
    assert checkpoints == expected and all(os.path.isfile(path) for _, path in checkpoints)
