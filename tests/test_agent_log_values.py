"""What run.log takes: values the sender cannot read as a real number are refused when logged, and one that
slips through costs only itself, never the points and steps recorded beside it."""

from __future__ import annotations

import fractions
import warnings
from typing import Any

import _runs
import numpy as np
import torch

import ampwatch


def test_values_that_have_no_real_number_are_refused_at_log_and_the_rest_arrives(memory, caplog) -> None:
    """Complex, meta, sparse, quantized and nested tensors cannot be read as a float on the sender thread:
    refused (and said once) when logged, so they cannot cost the points recorded beside them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (quantized and nested tensors are deprecated or a prototype)
        odd = {
            "complex": torch.tensor(1 + 2j),
            "meta": torch.empty((), device="meta"),
            "sparse": torch.tensor([1.0]).to_sparse(),
            "quantized": torch.quantize_per_tensor(torch.tensor([1.0]), 0.1, 0, torch.quint8),
            "nested": torch.nested.nested_tensor([torch.tensor([1.0])]),
        }
    with ampwatch.init("guest", "odd-values", transport=memory) as run:
        run.log({"before": 1.0, **odd, "t": torch.tensor(3.0)})
        run.log({"after": 2.0, "fraction": fractions.Fraction(3, 2)})  # any numbers.Real is a value
        run.log(
            {
                "np_bool": np.bool_(True),
                "np_int": np.int64(7),
                "np_nan": np.float32("nan"),
                "np_0d": np.array(-np.inf),
                "np_vector": np.array([1.0, 2.0]),
                "np_complex": np.complex64(1),
            }
        )
    series = memory.series(run.id)
    values = {name: data["values"] for name, data in series.items()}
    assert values.pop("np_nan") == ["NaN"]  # (how the API writes a stored NaN)
    assert values == {
        "before": [1.0],
        "t": [3.0],
        "after": [2.0],
        "fraction": [1.5],
        "np_bool": [1.0],
        "np_int": [7.0],
        "np_0d": ["-Infinity"],
    }
    for name in [*odd, "np_vector", "np_complex"]:
        assert f"{name!r} is not a real number" in caplog.text


class Unreadable(torch.Tensor):
    """A tensor the agent's checks at log time pass but whose value cannot be read (as some subclasses)."""

    def tolist(self) -> Any:
        raise RuntimeError("this tensor cannot be read")


def test_a_logged_value_that_cannot_be_read_on_the_sender_costs_only_itself(memory, caplog) -> None:
    with ampwatch.init("guest", "unreadable", transport=memory) as run:
        _runs.train(run, range(10))
        run.log({"ok": torch.tensor(1.0), "bad": torch.tensor(2.0).as_subclass(Unreadable), "plain": 3.0})
    series = memory.series(run.id)
    assert "bad" not in series and series["ok"]["values"] == [1.0] and series["plain"]["values"] == [3.0]
    assert series["loss"]["steps"] == list(range(10))  # the steps in the same batch arrived
    assert series["dropped_records"]["values"] == [1.0]  # counted where the user looks for losses
    assert series["dropped_records/unreadable"]["values"] == [1.0]  # and why
    assert "logged as 'bad' (step 10) cannot be read" in caplog.text


def test_a_name_the_server_refuses_is_refused_at_log_and_the_rest_of_its_batch_arrives(memory, caplog) -> None:
    """A NUL character, or a name of 0 or more than 200 characters: the server would refuse the whole batch
    holding it (a 422: the batch is dropped). And a project or run name with NUL is stored with U+FFFD."""
    with ampwatch.init("guest\x00", "nul\x00name", transport=memory) as run:
        run.log({"ok": 1.0, "bad\x00name": 2.0, "": 3.0, "x" * 201: 4.0}, step=0)
        run.log({"ok": 5.0}, step=1)
    assert memory.series(run.id) == {"ok": {"steps": [0, 1], "values": [1.0, 5.0]}}
    stored = memory.run(run.id)
    assert (stored["project"], stored["name"], stored["status"]) == ("guest\ufffd", "nul\ufffdname", "finished")
    assert "metric names must be strings of 1-200 characters without NUL" in caplog.text
