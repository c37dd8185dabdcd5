"""What one rank of a run lost, counted per reason, and reported as series (see docs/recording.md).

Each reason has one writer: `buffer_full` is counted by the threads that record (only when the buffer is full),
every other reason by the sender thread, or by `finish()` once the sender is done or timed out.
"""

from __future__ import annotations

from ampwatch._protocol import DROPPED, DROPPED_PREFIX

BUFFER_FULL = "buffer_full"  # records: the in-memory buffer was full (the sender fell behind, or was not running)
UNREADABLE = "unreadable"  # records: a value the sender could not read as a number (or not before finish() ended)
SPOOL_FULL = "spool_full"  # batches: neither the spool on disk nor memory could hold them until delivered
REJECTED = "rejected"  # batches: the server refused them for good (a 4xx other than auth and rate limits)
SPOOL_LOST = "spool_lost"  # batches: a spooled batch became unreadable, or its folder was removed
UNENCODABLE = "unencodable"  # batches: could not be written as JSON (a bug of the agent's)
REASONS = (BUFFER_FULL, UNREADABLE, SPOOL_FULL, REJECTED, SPOOL_LOST, UNENCODABLE)


class Losses:
    """Counts of lost records and batches per reason (the total mixes the two units, as `dropped_records` does)."""

    def __init__(self) -> None:
        self.counts = dict.fromkeys(REASONS, 0)
        self._reported: dict[str, int] = {}

    def add(self, reason: str, count: int = 1) -> bool:
        """Count `count` losses for `reason`; True when they are the reason's first (to say so once)."""
        first = self.counts[reason] == 0
        self.counts[reason] += count
        return first

    def __getitem__(self, reason: str) -> int:
        return self.counts[reason]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def unreported(self) -> dict[str, float]:
        """The series that changed since the last call: `dropped_records` (the total) and `dropped_records/<reason>`,
        each cumulative (a later batch carries them again if the batch with these is lost too)."""
        now = {DROPPED_PREFIX + reason: count for reason, count in self.counts.items() if count}
        now[DROPPED] = sum(now.values())
        changed = {name: float(count) for name, count in now.items() if self._reported.get(name, 0) != count}
        self._reported = now
        return changed
