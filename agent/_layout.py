"""How the watched model's parameters lie across the ranks, told to the server in the run's environment (`parallel`).

"replicated" under DistributedDataParallel: every rank holds the same parameters, bitwise, after each step (the
gradients are all-reduced and every rank's optimizer does the same arithmetic), so the server compares the ranks'
`param_norm` at each step (server/alerts/_desync.py). "sharded" under FSDP (a FullyShardedDataParallel module, or
DTensor parameters: FSDP2, tensor parallelism): each rank's `param_norm` is its shard's, and nothing is compared.
Anything else (one process, a framework's own data parallelism) is not said, and not compared. Known once a model is
watched, after init() registered the run: the run registers again, before its next batch.
"""

from __future__ import annotations

import sys
from typing import Any

from ampwatch._origin import wrapped


def layout(model: Any) -> str | None:
    """ "replicated", "sharded" or None (not known); see the module's docstring."""
    import torch

    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FullyShardedDataParallel", ())
    if any(isinstance(m, fsdp) or hasattr(p, "to_local") for m in model.modules() for p in m.parameters(False)):
        return "sharded"
    if any(isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in wrapped(model)):
        return "replicated"
    return None


def report(worker: Any, model: Any) -> None:
    """At watch(): say the model's layout in the run's environment (registered again when it changed)."""
    parallel = None if model is None else layout(model)
    if parallel is not None:
        worker.update_environment(parallel=parallel)
