"""Device scalars to host values, on the sender thread: CPU tensors read directly, the others in one
non-blocking copy per device."""

from __future__ import annotations

import time
from typing import Any

# CUDA device -> the streams the training thread has run steps on (see `note_stream`). The sender reads on its own
# stream, which must first wait for these: a loop under `torch.cuda.stream(side)` writes its values there.
_streams: dict[Any, tuple[Any, ...]] = {}
KEEP_STREAMS = 8  # the latest ones: a loop that makes a new stream now and then must not make every read slower


def note_stream(torch: Any) -> None:
    """On the training thread, at a step that does more (see ampwatch._step_end): remember its current CUDA stream."""
    if torch.cuda.is_initialized():  # (never initializes CUDA for a CPU run)
        stream = torch.cuda.current_stream()
        known = _streams.get(stream.device, ())
        if stream not in known:  # rare: a new stream; the tuple is replaced whole, so the sender reads either one
            _streams[stream.device] = (*known, stream)[-KEEP_STREAMS:]


def to_host(tensors: list[Any], deadline: float | None = None) -> list[Any]:
    """The values of all `tensors`, flattened, in order (read off the training thread); TimeoutError when a device
    has not finished computing them by `deadline` (time.monotonic())."""
    if not tensors:
        return []
    import torch  # only reached when the user logged tensors, so torch is there

    if all(t.is_cpu for t in tensors):  # training on the CPU: no grouping by device
        try:
            return _cpu_values(tensors)
        except RuntimeError:  # a DTensor (FSDP2, tensor parallelism) has no tolist()
            if all(t.__class__ is torch.Tensor for t in tensors):
                raise
            return _cpu_values([_local(t) for t in tensors])
    if not all(t.__class__ is torch.Tensor for t in tensors):  # (before any op: one on DTensors could be a collective)
        tensors = [_local(t) for t in tensors]
    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    if len(by_device) == 1:  # the usual case: one device, values already in order
        return _host_values(torch, tensors, next(iter(by_device)), deadline)
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + t.numel())
    flat: list[Any] = [0.0] * offsets[-1]
    for device, idx in by_device.items():
        values = _host_values(torch, [tensors[i] for i in idx], device, deadline)
        at = 0
        for i in idx:
            n = offsets[i + 1] - offsets[i]
            flat[offsets[i] : offsets[i + 1]] = values[at : at + n]
            at += n
    return flat


def _host_values(torch: Any, tensors: list[Any], device: Any, deadline: float | None) -> list[Any]:
    if device.type == "cpu":
        return _cpu_values(tensors)
    if device.type == "cuda":
        current = torch.cuda.current_stream(device)
        for stream in _streams.get(device, ()):
            if stream != current:
                current.wait_stream(stream)  # on the device: the copy below starts after what the loop queued there
    with torch.no_grad():  # everything here is already detached; this only saves the checks
        if all(t.dim() == 0 for t in tensors):  # one stack, no per-tensor reshape
            stacked = torch.stack(tensors).float()
        else:
            stacked = torch.cat([t.reshape(-1).float() for t in tensors])
    if device.type == "cuda":
        # This thread's current device is cuda:0 whatever the rank's: name the device, or the event
        # would be recorded on another GPU's stream and could report the copy done before it is.
        with torch.cuda.device(device):
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(device))
        while not copied.query():  # poll: never a blocking synchronize
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the device did not finish computing the values in time")
            time.sleep(0.001)
        stacked = host
    return stacked.tolist()


def _local(tensor: Any) -> Any:
    """A DTensor as this rank's local tensor, without a collective: with a Replicate placement (the total norm
    clip_grad_norm_ returns under FSDP2) the whole value; with a Partial one (the norms of sharded gradients) this
    rank's part, the norm of its shard. Other tensors as they are."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def _cpu_values(tensors: list[Any]) -> list[Any]:
    # Already computed (CPU ops run synchronously): reading each is cheaper than stacking them first. With
    # tolist(), not item(): item() lets go of the GIL, and every time it does, the training thread takes it
    # and this thread waits for the next chance (thousands of hand-overs a second, each costing both).
    values = [t.tolist() for t in tensors]
    if list not in map(type, values):  # all scalars: the usual case
        return values
    flat: list[Any] = []
    for t, value in zip(tensors, values):
        if value.__class__ is list:
            flat.extend(value if t.dim() == 1 else t.reshape(-1).tolist())
        else:
            flat.append(value)
    return flat
