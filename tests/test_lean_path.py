"""The lean path (ampwatch._step_end): lean hooks for the steps between the planned ones. Whatever a loop does
on those steps, a run records exactly what it records without them."""

from __future__ import annotations

from typing import Any

import _runs
import pytest
import torch

import ampwatch
from ampwatch import _step_end

SERIES = ["loss", "scale", "skipped", "grad_norm", "lr", "param_norm", "grad_norm/0", "grad_norm/2"]


# Steps that break the loop's pattern, each in a different stretch of plain steps (layer norms every 10 steps,
# parameter checks every 14: the steps between those, and not just before a layer step, are plain).
NO_CLIP, SUBSET_CLIP, TWO_LOSSES, L1_CLIP, LOGGED, SCALE_SET, RULE_SET, STEP_TWICE, RELOADED, OTHER_CLIP, ARMED = (
    3,
    12,
    16,
    22,
    32,
    44,
    47,
    54,
    52,
    57,
    61,
)
DROPPED = 29  # unscale_, then the loop drops the step (no clip, no step()) and calls update(); a layer step follows
STEPS = 70


def _train(server: Any, lean_seen: list[int]) -> dict[str, Any]:
    """A clipping fp16 loop whose steps break its own pattern now and then; the series and events the server
    has for it. `lean_seen` gets the steps that began with the lean hooks in place."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))  # not trained
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    batches = [torch.randn(4, 8) for _ in range(STEPS)]
    with ampwatch.init("lean", transport=server) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step, x in enumerate(batches):
            if run._recorder._lean_optimizer is not None:  # (private: which path this step begins on)
                lean_seen.append(step)
            if step == ARMED:
                # (private: what the sender's diagnosis asks after a non-finite value)
                run._recorder.mailbox.arm_step, run._recorder.mailbox.arm_request = step - 1, True
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            if step == TWO_LOSSES:  # two micro-batches: their losses are summed
                scaler.scale(loss / 2).backward(retain_graph=True)
                loss = loss / 2
            scaler.scale(loss).backward()
            if step == DROPPED:
                scaler.unscale_(optimizer)
                optimizer.zero_grad()
                scaler.update()
                scheduler.step()
                continue
            if step != NO_CLIP:  # (without a clip, the agent takes the norm itself)
                scaler.unscale_(optimizer)
                if step == SUBSET_CLIP:
                    torch.nn.utils.clip_grad_norm_(model[0].parameters(), 1.0)
                elif step == OTHER_CLIP:  # as many parameters, but another model's (without gradients: its norm is 0)
                    torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=1.0 if step == L1_CLIP else 2.0)
            scaler.step(optimizer)
            if step == STEP_TWICE:
                with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
                    scaler.step(optimizer)
            if step == LOGGED:
                run.log({"grad_norm": 5.0})
            scaler.update(2.0**12 if step == SCALE_SET else None)
            if step == RULE_SET:
                scaler.set_backoff_factor(0.25)
            if step == RELOADED:
                scaler.load_state_dict(scaler.state_dict())
            scheduler.step()
            optimizer.zero_grad()
    series = server.series(run.id, SERIES)
    events = server.events(run.id)
    return {"series": series, "events": [(e["type"], e["step"], e["details"].get("cause")) for e in events]}


def test_a_run_records_the_same_with_and_without_the_lean_path(memory, monkeypatch) -> None:
    monkeypatch.setenv("AMPWATCH_LAYER_NORM_INTERVAL", "10")
    monkeypatch.setenv("AMPWATCH_PARAM_CHECK_INTERVAL", "14")
    began_lean: list[int] = []
    lean = _train(memory, began_lean)
    monkeypatch.setattr(_step_end.StepEnd, "_enter_lean", lambda self: None)
    full = _train(memory, [])
    assert lean == full
    # It was a test of something: each of those steps began on the lean path.
    assert {
        NO_CLIP,
        SUBSET_CLIP,
        TWO_LOSSES,
        L1_CLIP,
        LOGGED,
        SCALE_SET,
        RULE_SET,
        STEP_TWICE,
        RELOADED,
        OTHER_CLIP,
        ARMED,
        DROPPED,
    } <= set(began_lean)
    series = lean["series"]
    # Every step has its norm, the one without a clip too; but where a clip the agent did not expect (over a
    # subset of the parameters, or an L1 one) changed the gradients before their norm was taken, that step has none,
    # nor has the step the loop dropped after zeroing its gradients.
    assert series["grad_norm"]["steps"] == [s for s in range(STEPS) if s not in (SUBSET_CLIP, L1_CLIP, DROPPED)]
    norms = dict(zip(series["grad_norm"]["steps"], series["grad_norm"]["values"]))
    assert norms[LOGGED] == 5.0 and norms[OTHER_CLIP] > 0  # (the agent's own norm there, not the other model's 0)
    assert series["loss"]["steps"] == list(range(STEPS)) and series["lr"]["values"][10] == 0.005
    assert series["grad_norm/0"]["steps"] == [
        0,
        10,
        20,
        30,
        40,
        50,
        60,
        *range(ARMED + 1, STEPS),
    ]  # and every step while the probe is armed
    assert series["scale"]["values"][SCALE_SET + 1] == 2.0**12
    assert ("scaler_misuse", STEP_TWICE, "step_twice") in lean["events"]


def test_plain_records_decode_to_exactly_what_step_records_do() -> None:
    """The sender decodes the lean path's plain records a column at a time: the same points as the step records
    the full path would have made, through a stretch without skips, skips (backoff), growth, non-finite values and
    a missing lr; and so do runs of plain records where those of the steps whose optimizer step ran hold no
    found_inf (kind APPLIED_STEP), as the sender groups them."""
    from ampwatch._protocol import APPLIED_STEP, LEAN_STEP, STEP
    from ampwatch._steps import StepDecoder, lean_tensors, step_tensors

    losses = [0.5, 0.75, 1.0, 0.5, float("nan"), 0.25, float("inf"), 0.125, 2.0, 1.0, 3.0, 0.0, -1.5]
    skips = [0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0, 1]
    norms = [1.0, 1.5, 0.5, 1.0, float("nan"), 2.0, float("inf"), 3.0, 4.0, 5.0, 6.0, 7.0, float("nan")]
    lrs = [0.1, 0.1, 0.1, 0.1, 0.1, None, 0.1, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]
    tensors = [
        (torch.tensor(loss), torch.tensor(float(f)), torch.tensor(n)) for loss, f, n in zip(losses, skips, norms)
    ]
    anchor = (
        STEP,
        0,
        None,
        tensors[0][1],
        None,
        True,
        (torch.tensor([1024.0]), torch.tensor([0])),
        (2.0, 0.5, 3),
        None,
        None,
    )
    decoded = []
    for kind in (STEP, LEAN_STEP, APPLIED_STEP):
        decoder, points = StepDecoder(), {}
        runs = [[anchor]]
        for start, end in ((0, 1), (1, len(losses))):  # (a stretch of one step, without a skip, then the rest)
            steps = range(start, end)
            if kind == STEP:
                runs.append([(STEP, s + 1, *tensors[s], True, None, None, lrs[s], None) for s in steps])
            elif kind == LEAN_STEP:
                runs.append([(LEAN_STEP, s + 1, *tensors[s], lrs[s]) for s in steps])
            else:  # the skipped steps' records hold found_inf, the others do not: runs of one kind each
                for s in steps:
                    loss, found, norm = tensors[s]
                    entry = (
                        (LEAN_STEP, s + 1, loss, found, norm, lrs[s])
                        if skips[s]
                        else (APPLIED_STEP, s + 1, loss, None, norm, lrs[s])
                    )
                    if runs[-1][0][0] != entry[0]:
                        runs.append([])
                    runs[-1].append(entry)
        assert kind != APPLIED_STEP or len(runs) == 7  # (it was a test of mixed runs: the anchor, then r p r p r p)
        for run in runs:
            values: list = []
            (step_tensors if run[0][0] == STEP else lean_tensors)(run, values)
            host = [v for t in values for v in (t.tolist() if t.dim() else [t.item()])]
            at = (decoder.decode if run[0][0] == STEP else decoder.decode_lean)(run, host, 0, points)
            assert at == len(host)
        decoded.append({name: (steps, [repr(v) for v in vals]) for name, (steps, vals) in points.items()})
    assert decoded[0] == decoded[1] == decoded[2]
    # (it was a test of both ways: the scale stayed, then backed off at the skips and grew after three good steps)
    assert [float(v) for v in decoded[1]["scale"][1]] == [
        1024,
        1024,
        1024,
        2048,
        2048,
        2048,
        1024,
        1024,
        512,
        512,
        512,
        1024,
        1024,
        1024,
    ]
    assert decoded[1]["lr"][0] == [s + 1 for s in range(len(lrs)) if lrs[s] is not None]


def test_lean_steps_record_exactly_the_steps_gradscaler_skipped(memory, monkeypatch) -> None:
    """A lean step whose optimizer step ran keeps no found_inf (the optimizer's post-step hook says GradScaler did not
    skip it); one GradScaler skipped keeps it. In a loop whose scale grows into fp16 overflows every other step, the
    skipped and scale series are exactly what GradScaler did, and the lean path made both kinds of record."""
    from ampwatch._protocol import APPLIED_STEP, LEAN_STEP
    from ampwatch._steps import StepDecoder

    kinds: list[tuple[str, int]] = []
    decode_lean = StepDecoder.decode_lean

    def spy(self: StepDecoder, records: list[tuple], *args: Any) -> int:
        kinds.extend((r[0], r[1]) for r in records)
        return decode_lean(self, records, *args)

    monkeypatch.setattr(StepDecoder, "decode_lean", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)  # doubles after every good step
    skipped, scales = [], []
    with ampwatch.init("skips", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(120):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            before = scaler.get_scale()
            scales.append(before)
            scaler.step(optimizer)
            scaler.update()
            skipped.append(1 if scaler.get_scale() < before else 0)  # GradScaler backs off exactly on a skip
            optimizer.zero_grad()
    series = memory.series(run.id, ["skipped", "scale"])
    assert series["skipped"]["steps"] == list(range(120)) and series["skipped"]["values"] == skipped
    assert series["scale"]["values"] == scales  # (the scale each step ran with, shadowed from the skips)
    ran = {step for kind, step in kinds if kind == APPLIED_STEP}
    held = {step for kind, step in kinds if kind == LEAN_STEP}
    assert sum(skipped) > 20 and len(ran) > 20 and len(held) > 20  # (it was a test of both)
    assert all(skipped[step] for step in held) and not any(skipped[step] for step in ran)


def test_the_post_step_hook_is_registered_once_per_optimizer_and_removed_at_finish(memory) -> None:
    """A loop that steps one optimizer for a while, then the other, and back: the lean path takes each in turn,
    and each keeps one hook of the agent's, however often it comes back; finish() removes them."""
    model = torch.nn.Linear(4, 1)
    first, second = (torch.optim.SGD(model.parameters(), lr=1e-3) for _ in range(2))
    scaler = torch.amp.GradScaler("cpu")
    lean_optimizers = set()
    with ampwatch.init("alternating", transport=memory) as run:
        run.watch(model=model, optimizer=[first, second], scaler=scaler)
        for step in range(400):
            optimizer = first if (step // 60) % 2 == 0 else second
            _runs.clipped_step(model, optimizer, scaler)
            if run._recorder._lean_optimizer is not None:  # (private: which optimizer the lean hooks are for)
                lean_optimizers.add(run._recorder._lean_optimizer)
        assert lean_optimizers == {first, second}  # (it was a test of coming back: 400 steps are 3 switches)
        assert len(first._optimizer_step_post_hooks) == len(second._optimizer_step_post_hooks) == 1
    assert not first._optimizer_step_post_hooks and not second._optimizer_step_post_hooks


def test_a_clip_of_one_tensor_records_its_norm_and_never_goes_lean(memory) -> None:
    """clip_grad_norm_ given a lone tensor (here the model's one parameter, 0-dim) covers the optimizer's parameters,
    so its norm is the step's; but it is not a list, so the lean hooks (which compare lists) never apply."""
    weight = torch.nn.Parameter(torch.tensor(0.5))
    optimizer = torch.optim.SGD([weight], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    clipped, lean = [], []
    with ampwatch.init("lone-tensor", transport=memory) as run:
        run.watch(optimizer=optimizer, scaler=scaler)
        for _ in range(120):
            lean.append(run._recorder._lean_optimizer is not None)  # (private: which path this step begins on)
            x = torch.randn(8)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (x * weight - 1.0).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            clipped.append(torch.nn.utils.clip_grad_norm_(weight, 1.0).item())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    norms = memory.series(run.id, ["grad_norm"])["grad_norm"]
    assert norms["steps"] == list(range(120))
    assert norms["values"] == pytest.approx(clipped, rel=1e-6)
    assert not any(lean)


def test_the_lean_hooks_are_built_once_per_pattern_and_again_when_the_clip_changes(memory, monkeypatch) -> None:
    """Each plan of plain steps puts the lean hooks in place; built for the same scaler, optimizer and clip as the
    last ones, they are the last ones. A clip of the same parameters in another order (another first and last)
    gets hooks of its own, and its norms are still the step's."""
    monkeypatch.setenv("AMPWATCH_LAYER_NORM_INTERVAL", "10")
    monkeypatch.setenv("AMPWATCH_PARAM_CHECK_INTERVAL", "10")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    built: list[Any] = []  # the lean scale() of each step that began on the lean path, per half of the run
    clipped = []
    with ampwatch.init("lean-cache", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for step in range(100):
            if run._recorder._lean_optimizer is not None:  # (private: the lean hooks in place)
                built.append((step >= 60, scaler.__dict__["scale"]))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            params = list(model.parameters())
            clipped.append(torch.nn.utils.clip_grad_norm_(params[::-1] if step >= 60 else params, 1.0).item())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    norms = memory.series(run.id, ["grad_norm"])["grad_norm"]
    assert norms["values"] == pytest.approx(clipped, rel=1e-6)
    first, second = ({id(hook) for later, hook in built if later == half} for half in (False, True))
    assert len([s for s, _ in built]) > 60  # (most steps were lean: 10 plans of 9 steps)
    assert len(first) == len(second) == 1 and first != second


def test_a_loop_that_names_gradscalers_arguments_runs_and_records_the_same(memory) -> None:
    """scale(outputs=...), unscale_(optimizer=...), step(optimizer=...), update(new_scale=None): the lean hooks take
    GradScaler's keywords as the full ones do (they once named the optimizer otherwise: a TypeError in the loop)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    lean, clipped = [], []
    with ampwatch.init("keywords", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for _ in range(120):
            lean.append(run._recorder._lean_optimizer is not None)  # (private: which path this step begins on)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            scaler.scale(outputs=loss).backward()
            scaler.unscale_(optimizer=optimizer)
            clipped.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0).item())
            scaler.step(optimizer=optimizer)
            scaler.update(new_scale=None)
            optimizer.zero_grad()
    norms = memory.series(run.id, ["grad_norm"])["grad_norm"]
    assert sum(lean) > 100
    values = [float(v) for v in norms["values"]]  # (non-finite values come as the strings JSON has for them)
    assert norms["steps"] == list(range(120)) and values == pytest.approx(clipped, rel=1e-6)


def test_a_loop_that_numbers_its_steps_from_one_stays_lean(memory) -> None:
    """run.log(..., step=i + 1) of names that are not standard is ahead of the agent's step every time: only a standard
    name logged ahead keeps the next step off the lean path."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    lean = []
    with ampwatch.init("lean", "numbered-from-one", transport=memory) as run:
        run.watch(model=model, optimizer=optimizer, scaler=scaler)
        for i in range(120):
            lean.append(run._recorder._lean_optimizer is not None)  # (private: which path this step begins on)
            run.log({"tokens_per_s": 1000.0}, step=i + 1)  # (before the step's update: ahead of the agent's step)
            _runs.clipped_step(model, optimizer, scaler)
    assert sum(lean) > 100
