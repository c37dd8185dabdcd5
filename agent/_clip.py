"""Clip tracking: whether the loop's `clip_grad_norm_` measures the step's gradient norm, so the agent reuses it.

A clip after `unscale_` over exactly the optimizer's parameters, with the 2-norm, returns the norm the agent would
compute itself: the verdict is reached once per clip pattern (parameters, norm type, parameter-group count) and
trusted while the loop keeps clipping the same way. Owned by the training thread (the Recorder's clip listener).
"""

from __future__ import annotations

from typing import Any

from ampwatch._mailbox import Mailbox


class ClipTracking:
    """The last clip pattern seen and whether its norm is the step's."""

    __slots__ = ("trusted", "seen", "groups", "params", "_ids_of", "_mailbox")

    def __init__(self, mailbox: Mailbox) -> None:
        self.trusted = False  # the last clip covered the optimizer's parameters: reuse its norm
        self.seen: tuple[Any, ...] = ()  # what that verdict was reached for: parameter ids, norm type, group count,
        # max_norm (a number, or None where it is a tensor: comparing tensors would sync)
        self.groups: Any = None  # and the optimizer's parameter-group list
        self.params: Any = None  # and the parameters themselves (the lean path compares identities)
        self._ids_of: tuple[Any, int, set[int]] | None = None
        self._mailbox = mailbox  # (tells the sender's diagnosis whether the loop clips)

    def judge(self, optimizer: Any, parameters: Any, seen: tuple[Any, ...]) -> None:
        """A clip over `parameters` (ids, norm type, group count, max_norm in `seen`) after `optimizer`'s unscale_:
        decide again whether to trust it, unless it is the pattern judged last (each step clips the same parameters)."""
        groups = optimizer.param_groups
        if groups is not self.groups or seen != self.seen:
            ids, own = seen[0], self.param_ids(optimizer)
            # The same parameters (ids are distinct, so equal counts and inclusion mean the same set), 2-norm.
            self.trusted = seen[1] == 2.0 and len(ids) == len(own) and all(map(own.__contains__, ids))
            self.seen, self.groups, self.params = seen, groups, parameters
            self._mailbox.clipping, self._mailbox.max_norm = True, seen[3]

    def forget(self) -> None:
        """No clip came where one was expected: the next clip decides again."""
        self.trusted, self.seen = False, ()
        self._mailbox.clipping, self._mailbox.max_norm = False, None

    def still_covers(self, optimizer: Any) -> bool:
        """The trusted clip was judged on this parameter-group list at this length: a group added since (unfrozen
        layers) may leave the clip short of the optimizer, and then only a norm taken before the clip is right."""
        groups = optimizer.param_groups
        return groups is self.groups and len(groups) == self.seen[2]

    def covers_gradients(self, optimizer: Any, ids: tuple[int, ...]) -> bool:
        """Whether a clip over `ids` covered every gradient of `optimizer` (its other parameters have none): its norm
        is the step's."""
        clipped = set(ids)
        return clipped <= self.param_ids(optimizer) and all(
            p.grad is None for group in optimizer.param_groups for p in group["params"] if id(p) not in clipped
        )

    def param_ids(self, optimizer: Any) -> set[int]:
        """The ids of the optimizer's parameters, cached per parameter-group list and length (a stale cache
        can only make a clip look foreign, and the agent then computes the norm itself)."""
        groups = optimizer.param_groups
        cached = self._ids_of
        if cached is None or cached[0] is not groups or cached[1] != len(groups):
            cached = self._ids_of = (groups, len(groups), {id(p) for group in groups for p in group["params"]})
        return cached[2]
