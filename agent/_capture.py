"""The input batch the NaN-origin probe named, kept so that it can be replayed (`AMPWATCH_CAPTURE_DIR`).

While the probe is armed (a few steps after a non-finite value, never in a healthy run), its hook on the watched
model's input takes a detached copy of every tensor the model received, positional and keyword arguments alike
(`Capture.take`, training thread): an asynchronous copy on the device, no host read. At most `max_bytes` of such
copies are held at once: a batch larger than that is never copied, nor one that would take the copies still waiting
for the sender past it; the event then says so instead of naming a file. The sender reads the probe's flags; when they
name the input batch, it writes that forward's copy and the step to the directory with `torch.save` (`Capture.write`,
sender thread) and the event names the file. Copies of the other armed forwards go with their records.
"""

from __future__ import annotations

import collections
import os
import time
import weakref
from typing import Any

from ampwatch import _host

PLAIN = (int, float, bool, str, bytes, type(None))  # non-tensor arguments kept as they are (anything else: its type)


class Captured:
    """One forward's arguments, their tensors detached copies (`nbytes` in all)."""

    __slots__ = ("args", "kwargs", "nbytes", "__weakref__")

    def __init__(self, args: Any, kwargs: Any, nbytes: int) -> None:
        self.args, self.kwargs, self.nbytes = args, kwargs, nbytes


class Capture:
    """Where a run's named input batches go, and how many bytes of copies it may hold. `_held` is the training
    thread's; `_freed` (sizes of copies let go, appended by whichever thread frees a record) is read there."""

    def __init__(self, directory: str, run_id: str, rank: int, max_bytes: int) -> None:
        self.directory, self.run_id, self.rank, self.max_bytes = directory, run_id, rank, max_bytes
        self._held = 0
        self._freed: collections.deque[int] = collections.deque()

    @classmethod
    def of(cls, settings: Any, run_id: str, rank: int) -> Capture | None:
        """The run's capture, or None when `AMPWATCH_CAPTURE_DIR` is not set (the default)."""
        if not settings.capture_dir:
            return None
        return cls(os.path.expanduser(settings.capture_dir), run_id, rank, settings.capture_max_bytes)

    def take(self, args: Any, kwargs: Any) -> Captured | str:
        """Training thread, in an armed forward: a copy of the model's arguments, or why there is none."""
        import torch

        while self._freed:
            self._held -= self._freed.popleft()
        tensors: list[Any] = []
        _tensors((args, kwargs), torch.Tensor, tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if nbytes > self.max_bytes:
            return f"its {nbytes} bytes of tensors are over AMPWATCH_CAPTURE_MAX_BYTES ({self.max_bytes})"
        if self._held + nbytes > self.max_bytes:
            return (
                f"copies of earlier armed steps' batches ({self._held} bytes) still waited for the sender, and its "
                f"{nbytes} bytes would have held more than AMPWATCH_CAPTURE_MAX_BYTES ({self.max_bytes})"
            )
        with torch.no_grad():
            captured = Captured(_copied(args, torch.Tensor), _copied(kwargs, torch.Tensor), nbytes)
        self._held += nbytes
        weakref.finalize(captured, self._freed.append, nbytes)
        return captured

    def write(self, step: int, captured: Captured, micro_batch: int) -> str:
        """Sender thread: save `captured` and the step; the file's path."""
        import torch

        os.makedirs(self.directory, exist_ok=True)
        name = f"ampwatch-{self.run_id}-rank{self.rank}-step{step}" + (f"-micro{micro_batch}" if micro_batch else "")
        path = os.path.join(os.path.abspath(self.directory), name + ".pt")
        document = {
            "step": step,
            "rank": self.rank,
            "run_id": self.run_id,
            "micro_batch": micro_batch,
            "args": _on_host(captured.args, torch),
            "kwargs": _on_host(captured.kwargs, torch),
        }
        partial = path + ".partial"
        torch.save(document, partial)
        os.replace(partial, path)  # (a replay never finds half a file)
        return path


def _tensors(value: Any, tensor: Any, out: list[Any]) -> None:
    if isinstance(value, tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _tensors(item, tensor, out)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, tensor, out)


def _copied(value: Any, tensor: Any) -> Any:
    """`value` with each tensor a detached copy (on its device, queued: no host read), and each argument that is
    neither a tensor, a container of them nor a plain value replaced by the name of its type."""
    if isinstance(value, tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copied(v, tensor) for v in value) if type(value) in (tuple, list) else tuple(value)
    if isinstance(value, dict):
        return {k: _copied(v, tensor) for k, v in value.items()}
    return value if isinstance(value, PLAIN) else f"<{type(value).__qualname__}: not captured>"


def _on_host(value: Any, torch: Any) -> Any:
    """`value` with its CUDA tensors read to the host, on the sender's own stream and polled, never synchronized."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cuda":
            return _from_cuda(value, torch)
        return value if value.device.type == "cpu" else value.cpu()
    if isinstance(value, (tuple, list)):
        return type(value)(_on_host(v, torch) for v in value)
    if isinstance(value, dict):
        return {k: _on_host(v, torch) for k, v in value.items()}
    return value


def _from_cuda(value: Any, torch: Any) -> Any:
    with torch.cuda.device(value.device):
        current = torch.cuda.current_stream(value.device)
        for stream in _host._streams.get(value.device, ()):  # (the copy was queued on the loop's stream)
            if stream != current:
                current.wait_stream(stream)
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(current)
    while not copied.query():
        time.sleep(0.001)
    return host
