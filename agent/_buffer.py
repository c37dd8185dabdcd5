"""The sender's buffer: the records on their way from the training thread to the sender thread, and back.

Two deques, each with one writer at either end (appends and pops of a deque are atomic under the GIL, and never
block): `records`, which the training thread appends to and the sender drains; and `read`, the lists of records the
sender has read, which the training thread frees (`free_read_records`). Bounded: past `max_records` a data record (a
step, logged values, an origin) is dropped and counted in `ampwatch._losses` as `buffer_full`; events, statuses and
flush markers are few and always kept, so a run's end is never lost.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from ampwatch._losses import BUFFER_FULL, Losses
from ampwatch._protocol import DATA_KINDS

log = logging.getLogger("ampwatch")

KEEP_READ = 8  # lists of records read by the sender, kept for the training thread to free, at most
FAST_RECORDS = 1024  # step records appended in a row without `RecordBuffer.append`'s checks, at most (a power of 2)


class RecordBuffer:
    """One run's record buffer (see the module's docstring for who writes what)."""

    __slots__ = ("records", "read", "_max_records", "_losses")

    def __init__(self, max_records: int, losses: Losses) -> None:
        self.records: collections.deque[tuple] = collections.deque()  # training thread -> sender
        self.read: collections.deque[list[tuple]] = collections.deque()  # sender -> training thread, to free
        self._max_records = max_records
        self._losses = losses

    def __len__(self) -> int:
        return len(self.records)

    # -- training thread side -------------------------------------------------------------
    def append(self, entry: tuple) -> Callable[[tuple], None] | None:
        """Append a record without blocking; past the cap, count a data record as dropped. While `FAST_RECORDS` more
        records fit, return the deque's own `append`: the Recorder then appends step records with it directly,
        coming back here every `FAST_RECORDS` steps."""
        records = self.records
        if len(records) >= self._max_records and entry[0] in DATA_KINDS:
            if self._losses.add(BUFFER_FULL):
                log.warning("ampwatch: the record buffer is full, dropping records (counted)")
            return None
        records.append(entry)
        return records.append if len(records) + FAST_RECORDS < self._max_records else None

    def free_read_records(self) -> None:
        """Free the records the sender has read. Freeing a tensor lets go of the GIL; on the sender each one handed the
        GIL to the training thread and waited to have it back (see bench/NOTES.md), here nobody waits."""
        read = self.read
        try:
            while read:
                read.popleft()
        except IndexError:  # (the sender let go of the oldest itself meanwhile)
            pass

    # -- sender thread side ---------------------------------------------------------------
    def drain(self) -> list[tuple]:
        """Take every record appended so far, in order."""
        entries = []
        records = self.records
        while records:
            entries.append(records.popleft())
        return entries

    def keep_read(self, entries: list[tuple]) -> None:
        """Hand records the sender has read to the training thread, which frees them (see `free_read_records`); past
        `KEEP_READ` lists (a run that only logs values frees none at steps) the oldest goes here."""
        if entries:
            if len(self.read) >= KEEP_READ:
                self.read.popleft()
            self.read.append(entries)

    def restart_in_child(self, losses: Losses) -> None:
        """In a forked child: none of the parent's records; its losses are counted apart."""
        self.records.clear()
        self.read.clear()
        self._losses = losses
