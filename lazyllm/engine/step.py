"""What the scheduler decides for a step, as values the loop and the runner execute.

The scheduler decides; the engine loop and the model runner carry the decision out and read
it, never the scheduler's queues: ``Admission`` (which waiting requests a step admits, which
failed) and ``DecodeBatch`` (which rows one decode step runs, which ride along with no page,
which read their input from the step still in flight; rows preempted for room have left it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .request import Request


class Admission(NamedTuple):
    """A step's admission (``Scheduler.admit``): the requests admitted, in order, their pages
    planned; and the ones that failed, out of the queue, with the errors for their callers."""

    admitted: list[Request]
    failed: list[tuple[Request, Exception]]


@dataclass(frozen=True)
class DecodeBatch:
    """One decode step as the scheduler decided it (``Scheduler.decode_batch``), for the
    runner to launch (``ModelRunner.launch_decode``).

    reqs : the decoding requests in row order (the decode state's rows 0..B-1), each with
        its next token's slot claimed in its last page.
    pending : requests (by ``id``) whose latest token is still in the unread step in flight,
        to their row there: their input is that step's pick on the device.
    dead : requests (by ``id``) that ride along with no page (their K/V to the scratch slot,
        their token dropped): they reach their length or context limit with the token in
        flight.
    """

    reqs: tuple[Request, ...]
    pending: Mapping[int, int]
    dead: frozenset[int]

    @classmethod
    def of(cls, reqs, pending: Mapping[int, int], dead) -> DecodeBatch:
        return cls(tuple(reqs), MappingProxyType(dict(pending)), frozenset(dead))

    @staticmethod
    def dead_rows(rows, pending: Mapping[int, int], max_context: int) -> set[int]:
        """Of the decoding ``rows`` whose latest token is in the step in flight (``pending``),
        those (by ``id``) that reach their length or context limit with it: they ride along in
        the next step as dead rows (no page, K/V to the scratch slot, token dropped)."""
        return {r.id for r in rows if r.id in pending and (
            len(r.state.generated) + 1 >= r.params.max_new_tokens or r.state.next_pos + 1 >= max_context)}
