"""AMPWATCH_CAPTURE_DIR: when the NaN-origin probe names the input batch, the batch the model received is written
for a replay, on a real CPU training loop with a poisoned batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ampwatch


class Masked(torch.nn.Module):
    """A model that takes a keyword argument too, as most do (an attention mask, labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, tag: str = "") -> torch.Tensor:
        h = torch.tanh(self.first(x))
        return self.second(h if mask is None else h * mask)


POISONED = (5, 15)  # the first arms the probe (after a flush), which names the input batch at the second


def _train(
    memory: Any, steps: int = 20, keywords: bool = False
) -> tuple[list[dict[str, Any]], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """A GradScaler loop whose batches at POISONED hold a NaN and an Inf; the events and each step's inputs. With
    `keywords`, the model is called with keyword arguments only."""
    torch.manual_seed(0)
    model = Masked()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    with ampwatch.init("capture", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(steps):
            x, mask = torch.randn(16, 8), (torch.rand(16, 16) > 0.1).float()
            if step in POISONED:
                x[2, 3], x[7, 0] = float("nan"), float("inf")
            seen[step] = (x.clone(), mask.clone())
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x=x, mask=mask, tag="train") if keywords else model(x, mask=mask, tag="train")
                loss = out.float().pow(2).mean()
            x.zero_()  # (a loop that reuses its input buffer: the copy is what the model received, not this)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            if step == POISONED[0]:
                assert run.flush()  # the sender sees the first bad step and asks for the probe
    return memory.events(run.id), seen


def _origin(events: list[dict[str, Any]]) -> dict[str, Any]:
    [origin] = [e for e in events if e["details"].get("origin") == "(input batch)"]
    assert origin["step"] == POISONED[1]
    return origin


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_the_named_input_batch_is_written_for_a_replay(memory, tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "captures"
    monkeypatch.setenv("AMPWATCH_CAPTURE_DIR", str(folder))
    events, seen = _train(memory)
    origin = _origin(events)
    path = Path(origin["details"]["capture"])
    assert path.parent == folder and path.is_file()
    assert [p.name for p in folder.iterdir()] == [path.name]  # only the named forward's (the other armed ones: none)
    assert f"The batch was saved to {path}" in origin["message"]
    saved = torch.load(path)  # (weights_only, torch's default: plain tensors, tuples, dicts and strings)
    assert (saved["step"], saved["rank"], saved["micro_batch"]) == (POISONED[1], 0, 0)
    [x] = saved["args"]
    _same(x, seen[POISONED[1]][0])
    assert torch.isnan(x[2, 3]) and torch.isinf(x[7, 0])
    assert set(saved["kwargs"]) == {"mask", "tag"} and saved["kwargs"]["tag"] == "train"
    _same(saved["kwargs"]["mask"], seen[POISONED[1]][1])
    replayed = Masked()(*saved["args"], **saved["kwargs"])  # the bad sample again, outside the run
    assert not replayed.isfinite().all()


def test_a_model_called_with_keywords_only_has_its_input_batch_named_and_written(
    memory, tmp_path: Path, monkeypatch
) -> None:
    """`model(x=batch, ...)`, as Hugging Face models are called: the probe reads the input from the keywords."""
    monkeypatch.setenv("AMPWATCH_CAPTURE_DIR", str(tmp_path))
    events, seen = _train(memory, keywords=True)
    origin = _origin(events)
    assert "data problem" in origin["message"] and origin["details"]["order"][0] == "(input batch)"
    saved = torch.load(origin["details"]["capture"])
    assert saved["args"] == () and set(saved["kwargs"]) == {"x", "mask", "tag"}
    _same(saved["kwargs"]["x"], seen[POISONED[1]][0])


def test_nothing_is_copied_or_written_without_the_setting(memory, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("AMPWATCH_CAPTURE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("ampwatch._capture.Capture.take", _never)
    events, _ = _train(memory)
    origin = _origin(events)
    assert "capture" not in origin["details"] and "capture_error" not in origin["details"]
    assert "saved" not in origin["message"]
    assert list(tmp_path.rglob("*")) == []


def _never(*args: Any) -> Any:
    raise AssertionError("copied an input without AMPWATCH_CAPTURE_DIR")


@pytest.mark.parametrize("bound", [0, 16 * 8 * 4 + 16 * 16 * 4 - 1])  # (the batch is 16x8 and 16x16 float32)
def test_a_batch_over_the_bound_is_not_copied_and_the_event_says_so(memory, tmp_path: Path, monkeypatch, bound) -> None:
    folder = tmp_path / "captures"
    monkeypatch.setenv("AMPWATCH_CAPTURE_DIR", str(folder))
    monkeypatch.setenv("AMPWATCH_CAPTURE_MAX_BYTES", str(bound))
    events, _ = _train(memory)
    origin = _origin(events)
    assert "capture" not in origin["details"]
    reason = f"its 1536 bytes of tensors are over AMPWATCH_CAPTURE_MAX_BYTES ({bound})"
    assert origin["details"]["capture_error"] == reason
    assert f"The batch was not saved: {reason}." in origin["message"]
    assert not folder.exists()


def test_a_folder_that_cannot_be_written_is_said_in_the_event(memory, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("AMPWATCH_CAPTURE_DIR", str(tmp_path / "file" / "captures"))
    events, _ = _train(memory)
    origin = _origin(events)
    assert origin["details"]["capture_error"].startswith(f"writing it to {tmp_path / 'file' / 'captures'} failed: ")
    assert "The batch was not saved: writing it to" in origin["message"]


def test_copies_waiting_for_the_sender_bound_the_next_ones_until_they_are_let_go(tmp_path: Path) -> None:
    from ampwatch._capture import Capture, Captured

    capture = Capture(str(tmp_path), "r", 0, max_bytes=1000)
    batch = torch.randn(16, 8)  # 512 bytes
    first = capture.take((batch,), {})
    assert isinstance(first, Captured) and first.nbytes == 512 and first.args[0] is not batch
    second = capture.take((batch,), {"more": batch[:1]})
    assert second == (
        "copies of earlier armed steps' batches (512 bytes) still waited for the sender, and its 544 bytes would "
        "have held more than AMPWATCH_CAPTURE_MAX_BYTES (1000)"
    )
    del first  # (its record freed, read or dropped)
    third = capture.take((batch,), {"more": batch[:1]})
    assert isinstance(third, Captured) and third.nbytes == 544
