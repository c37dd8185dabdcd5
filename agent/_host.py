"""Device scalars to host floats, on the sender thread, in one copy per device."""

from __future__ import annotations

import time
from typing import Any


def to_host(tensors: list[Any]) -> Any:
    """Copy all device scalars to the host at once (off the training thread) and iterate them."""
    if not tensors:
        return iter(())
    import torch  # only reached when the user logged tensors, so torch is there

    by_device: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    if len(by_device) == 1:  # the usual case: one device, values already in order
        return iter(_host_values(torch, tensors, next(iter(by_device))))
    flat: list[float] = [0.0] * sum(t.numel() for t in tensors)
    offsets = [0]
    for t in tensors:
        offsets.append(offsets[-1] + t.numel())
    for device, idx in by_device.items():
        it = iter(_host_values(torch, [tensors[i] for i in idx], device))
        for i in idx:
            for j in range(offsets[i], offsets[i + 1]):
                flat[j] = next(it)
    return iter(flat)


def _flat(tensor: Any) -> Any:
    import torch

    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.float32 else flat.float()


def _host_values(torch: Any, tensors: list[Any], device: Any) -> list[float]:
    with torch.no_grad():  # everything here is already detached; this only saves the checks
        if all(t.dim() == 0 for t in tensors):  # the usual case: one stack, no per-tensor reshape
            values = torch.stack(tensors).float()
        else:
            values = torch.cat([_flat(t) for t in tensors])
    if device.type == "cuda":
        # This thread's current device is cuda:0 whatever the rank's: name the device, or the event
        # would be recorded on another GPU's stream and could report the copy done before it is.
        with torch.cuda.device(device):
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(device))
        while not copied.query():  # poll: never a blocking synchronize
            time.sleep(0.001)
        values = host
    return values.tolist()
