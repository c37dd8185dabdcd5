"""Per-step cost and host-device syncs of the agent on a CUDA mixed-precision training loop.

The loop: a small GPT-style model (token embedding, `--layers` pre-norm transformer blocks, a vocabulary
head) under `torch.autocast("cuda", float16)`, fused AdamW, `torch.amp.GradScaler("cuda")`, with
scale/backward, unscale_, clip_grad_norm_, step, update, zero_grad: nothing in it reads a value on the
host, so a sync would be a logger's. Conditions, each on its own copy of the same model (same seed):

  none          the plain loop
  none-again    the plain loop on a second copy: what the method reads when nothing differs (its noise)
  ampwatch      `ampwatch.init(...)` + `run.watch(model, optimizer, scaler)` + `run.log({"loss": loss})`,
                sending to a real `ampwatch server` started by this script (SQLite in a temporary folder)
  ampwatch-off  AMPWATCH_MODE=disabled: what the hooks cost with nothing sent
  tensorboard   `SummaryWriter.add_scalar` of loss, scale, grad norm, as users write it (`.item()`, if installed)

Measurements:

  step time     blocks of `--steps` steps per condition, interleaved in shuffled rounds, each block timed
                from a `torch.cuda.synchronize()` to the next; overhead = median over rounds of the block
                time against the same round's `none` block; IQR = its 25th..75th percentile over rounds.
  paired        steps alternate between `none` and the condition, in random order within each pair, each
                step timed between two `torch.cuda.synchronize()`: overhead = mean(t_cond - t_none) /
                median(t_none), the top and bottom 1 % of pairs left out. Steady, but a ceiling: with the
                queue drained at every step, CPU time the agent spends is never hidden behind the GPU's.
  syncs         `torch.cuda.set_sync_debug_mode("warn")` over `--count-steps` steps per condition: the
                synchronizing calls torch reports (the agent's sender thread included), per step.

Two model sizes show the two regimes: a small one whose step is bound by the CPU issuing kernels (where any
CPU the agent spends on the training thread shows), and a larger one bound by the GPU.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Server, scratch_database  # noqa: E402


def build(width: int, layers: int, vocab: int, seed: int, device: str) -> tuple[Any, Any, Any]:
    import torch

    torch.manual_seed(seed)

    def block() -> torch.nn.Module:
        return torch.nn.TransformerEncoderLayer(
            width, max(1, width // 64), 4 * width, dropout=0.0, batch_first=True, norm_first=True
        )

    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, width),
        *[block() for _ in range(layers)],
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, vocab),
    ).to(device)
    fused = device == "cuda"
    return model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused), torch.amp.GradScaler(device)


class Loop:
    """One condition's model, optimizer and scaler, and what it logs after each step."""

    def __init__(self, name: str, args: argparse.Namespace, server_url: str, tmp: str) -> None:
        import torch

        self.name, self.device = name, args.device
        self.model, self.optimizer, self.scaler = build(args.width, args.layers, args.vocab, 0, args.device)
        gen = torch.Generator(device="cpu").manual_seed(1)
        self.x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
        self.y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
        self.run: Any = None
        self.writer: Any = None
        self.step_index = 0
        if name.startswith("ampwatch"):
            import ampwatch

            os.environ["AMPWATCH_MODE"] = "disabled" if name == "ampwatch-off" else "online"
            try:
                self.run = ampwatch.init(project="bench-gpu", name=f"gpu-{name}", url=server_url)
            finally:
                os.environ.pop("AMPWATCH_MODE")
            self.run.watch(model=self.model, optimizer=self.optimizer, scaler=self.scaler)
        elif name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(tmp, "tb"))

    def step(self) -> None:
        import torch

        with torch.autocast(self.device, dtype=torch.float16):
            logits = self.model(self.x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), self.y.flatten())
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.run is not None:
            self.run.log({"loss": loss})
        elif self.writer is not None:
            self.writer.add_scalar("loss", loss.item(), self.step_index)
            self.writer.add_scalar("scale", self.scaler.get_scale(), self.step_index)
            self.writer.add_scalar("grad_norm", norm.item(), self.step_index)
        self.step_index += 1

    def block(self, steps: int) -> float:
        import torch

        sync = torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        sync()
        return (time.perf_counter() - start) / steps

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
        if self.writer is not None:
            self.writer.close()


def count_syncs(loop: Loop, steps: int) -> float:
    """Synchronizing CUDA calls torch reports per step while `loop` runs `steps` steps (sender included)."""
    import torch

    loop.block(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                loop.step()
            if loop.run is not None and loop.run._worker is not None:  # (private: wait for the sender's reads)
                loop.run._worker.flush(60)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught) / steps


def paired_overhead(loops: list[Loop], name: str, pairs: int, rng: random.Random) -> float:
    """Mean synced step time of `name` minus the plain loop's over adjacent pairs, over the plain median."""
    base = next(loop for loop in loops if loop.name == "none")
    cond = next(loop for loop in loops if loop.name == name)
    if cond is base or not pairs:
        return 0.0 if pairs else float("nan")
    diffs, plain = [], []
    for _ in range(pairs):
        first, second = (base, cond) if rng.random() < 0.5 else (cond, base)
        t = {first.name: first.block(1)}
        t[second.name] = second.block(1)
        diffs.append(t[name] - t["none"])
        plain.append(t["none"])
    diffs.sort()
    cut = len(diffs) // 100
    kept = diffs[cut : len(diffs) - cut]
    return statistics.fmean(kept) / statistics.median(plain)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conditions", default="none,none-again,ampwatch,ampwatch-off,tensorboard")
    parser.add_argument("--sizes", default="256x2,1024x8", help="WIDTHxLAYERS, comma-separated (default 256x2,1024x8)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--rounds", type=int, default=20, help="shuffled rounds of one block per condition (default 20)"
    )
    parser.add_argument("--steps", type=int, default=50, help="steps per block (default 50)")
    parser.add_argument("--pairs", type=int, default=300, help="step pairs per condition, 0 to skip (default 300)")
    parser.add_argument(
        "--count-steps", type=int, default=50, help="steps per condition for sync counting (default 50)"
    )
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu only to try the script")
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (run with --device cpu to try the script)")
        return 1
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"ampwatch agent on a GPU loop: torch {torch.__version__}, {name}; batch {args.batch} x {args.seq} tokens, "
        f"fp16 autocast, fused AdamW, GradScaler, clip_grad_norm_; {args.rounds} rounds x {args.steps} steps",
        flush=True,
    )
    names = [c for c in args.conditions.split(",") if c]
    if "tensorboard" in names and not _has("torch.utils.tensorboard"):
        names.remove("tensorboard")
        print("tensorboard: not installed, left out")
    rng = random.Random(0)
    with (
        tempfile.TemporaryDirectory(prefix="ampwatch-gpu-") as tmp,
        scratch_database("sqlite") as db_url,
        Server(db_url, Path(tmp) / "server.log") as server,
    ):
        server.wait_ready()
        for size in args.sizes.split(","):
            width, layers = (int(v) for v in size.split("x"))
            args.width, args.layers = width, layers
            loops = [Loop(n, args, server.url, tmp) for n in names]
            try:
                syncs = {
                    loop.name: count_syncs(loop, args.count_steps) if args.device == "cuda" else float("nan")
                    for loop in loops
                }
                times: dict[str, list[float]] = {loop.name: [] for loop in loops}
                for loop in loops:
                    loop.block(20)  # warm-up: allocator, kernels' first launch, the sender's connection
                for _ in range(args.rounds):
                    rng.shuffle(loops)
                    for loop in loops:
                        times[loop.name].append(loop.block(args.steps))
                paired = {loop.name: paired_overhead(loops, loop.name, args.pairs, rng) for loop in loops}
            finally:
                for loop in loops:
                    loop.close()
            base = times["none"]
            print(
                f"\nmodel width {width}, {layers} layers "
                f"({sum(p.numel() for p in loops[0].model.parameters()) / 1e6:.1f} M parameters): "
                f"step {statistics.median(base) * 1e3:.3f} ms without a logger"
            )
            print(
                f"{'condition':<14}{'step ms':>9}{'overhead':>10}{'IQR over rounds':>20}{'paired':>9}{'syncs/step':>12}"
            )
            for n in names:
                ratios = [(t / b - 1) * 100 for t, b in zip(times[n], base)]
                q1, q2, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                print(
                    f"{n:<14}{statistics.median(times[n]) * 1e3:>9.3f}{q2:>+9.2f}%{q1:>+10.2f}%..{q3:>+6.2f}%"
                    f"{paired[n] * 100:>+8.2f}%{syncs[n]:>12.2f}",
                    flush=True,
                )
    return 0


def _has(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
