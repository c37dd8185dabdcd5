"""ampwatch: watch the numerics of PyTorch training and get told, with a diagnosis, when a run goes wrong.

    import ampwatch
    run = ampwatch.init(project="llm", name="exp-12", config={"lr": 3e-4})
    run.watch(model=model, optimizer=optimizer, scaler=scaler)

This package is the agent: standard library only. The server is `ampwatch.server` (the `server` extra).
"""

from ampwatch._run import Run, init
from ampwatch._stop import StopRequested
from ampwatch._transport import Response, Transport

__version__ = "0.1.0"
__all__ = ["Response", "Run", "StopRequested", "Transport", "init", "__version__"]
