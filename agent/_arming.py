"""When the NaN-origin probe is armed, and what an armed step hands the sender.

The sender's diagnosis asks for an arming after a non-finite value (through the mailbox, see
`ampwatch._mailbox`); at the end of each full step the training thread turns the request into an arming of the
probe (`ampwatch._origin.OriginProbe`), unless the last arming already covered the event's step, and records the
flags an armed probe collected (an ORIGIN record) for the sender to read. Owned by the training thread.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ampwatch._mailbox import Mailbox
from ampwatch._origin import OriginProbe
from ampwatch._protocol import ORIGIN

BLIND = (
    "The NaN-origin probe, armed after a non-finite value, saw no forward pass of the watched model in a whole step: "
    "its hooks did not run, so it cannot say where NaN/Inf come from. Most likely the model was compiled after watch() "
    "(torch.compile(model): the compiled graph does not run hooks added to the modules inside it later): pass the "
    "compiled model to watch() instead, and the probe tells a bad input batch from the model; run uncompiled to have "
    "it name the module. Or the loop calls another model than the one passed to watch()."
)


class ProbeArming:
    """The armings of one run's probe: their number (`count`, which the flags and the diagnosis's hits carry) and
    the steps the last one covered. `config` records an amp_config warning (the probe saw no forward)."""

    __slots__ = ("count", "_covered", "_mailbox", "_record", "_config")

    def __init__(
        self, mailbox: Mailbox, record: Callable[[tuple], Any], config: Callable[[str, dict[str, Any]], None]
    ) -> None:
        self.count = 0
        self._covered = (0, 0)  # the last arming's event, and the first step after its probe was gone
        self._mailbox, self._record, self._config = mailbox, record, config

    def end_of_step(self, probe: OriginProbe, step: int) -> bool:
        """Hand over the armed probe's flags for `step`; arm or disarm it as the diagnosis asked. Returns whether
        the probe is armed."""
        mailbox = self._mailbox
        if probe.armed:
            import torch

            fwd_names, fwd, bwd_names, bwd = probe.take()
            inputs = probe.take_inputs() or None
            if fwd or bwd:
                flags = (torch.stack(fwd) if fwd else None, torch.stack(bwd) if bwd else None)
                self._record((ORIGIN, step, self.count, fwd_names, flags[0], bwd_names, flags[1], inputs))
            elif not probe.blind_said:
                probe.blind_said = True
                self._config(BLIND, {"probe": "no forward seen", "armed_step": step})
            probe.steps_left -= 1
            if (
                probe.steps_left <= 0
            ):  # (armed to the end after a hit too: its per-layer norms every step make the heatmap)
                probe.disarm()
                # A request pending after a hit is from the same episode (the range below misses it if the user
                # numbers steps).
                mailbox.arm_request = mailbox.arm_request and mailbox.origin_found != self.count
        if mailbox.arm_request and not probe.armed:
            mailbox.arm_request = False
            # Not for an event from the last arming's own on: it saw it or was armed after it (one before: a step the
            # user numbered otherwise: armed). Its flags were recorded before this event's step, so whether it missed
            # is known.
            start, end = self._covered
            if not start <= mailbox.arm_step < end:
                probe.capture = mailbox.capture  # (None unless AMPWATCH_CAPTURE_DIR is set)
                probe.arm(missed=self.count > 0 and mailbox.origin_found != self.count)
                self.count += 1
                self._covered = (mailbox.arm_step, step + 1 + probe.window)
        return probe.armed
