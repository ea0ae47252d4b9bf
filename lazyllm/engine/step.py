"""What the parts decide for a step, as values the loop and the runner execute.

The scheduler, the KV planner and quality recovery decide; the engine loop and the model
runner carry the decision out and read it, never another part's queues or state:
``Admission`` (which waiting requests a step admits, which failed), ``Recomputation`` (what
recovery recomputes of one request: its replacement job and the page copies it needs),
``PrefillBatch`` (each request's own job and the page copies to make before it, from the
planner's plans and recovery's recomputations) and ``DecodeBatch`` (which rows one decode step
runs, which ride along with no page, which read their input from the step still in flight;
rows preempted for room have left it).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .request import Job, Request

Copies = tuple[tuple[int, int, int], ...]  # ``(src page, dst page, delta)`` re-rotated page copies


class Admission(NamedTuple):
    """A step's admission (``Scheduler.admit``): the requests admitted, in order, their pages
    planned; and the ones that failed, out of the queue, with the errors for their callers."""

    admitted: list[Request]
    failed: list[tuple[Request, Exception]]


@dataclass(frozen=True)
class Recomputation:
    """What quality recovery decided for one request (``Recovery.apply``); it writes nothing
    of the request's plan (``PrefillPlan.recomputed`` records the counts).

    job : the request's own job in place of the planner's: the recomputed chunk tokens at
        their positions and slots, then the suffix.
    copies : the private page copies the recomputed tokens are written to, made after the
        planner's.
    reused : how many of the recomputed tokens the plan counted as read from the cache.
    computed : how many chunk tokens it recomputes.
    """

    job: Job
    copies: Copies
    reused: int
    computed: int


@dataclass(frozen=True)
class PrefillBatch:
    """An admission round's own prefill as the engine decided it (``Engine.before_own``),
    from the planner's plans and recovery's recomputations: the page copies are made first
    (``ModelRunner.make_copies``), then the jobs run (``ModelRunner.run_jobs``, or in pieces
    by mixed steps).

    reqs : the requests whose own job runs, in order (warm-only requests have none).
    jobs : each one's job: recovery's (``Recomputation.job``) where it recomputes, else the
        planner's.
    copies : per planned request of the round, in order, the page copies to make before any
        job runs: the planner's, then recovery's.
    """

    reqs: tuple[Request, ...]
    jobs: tuple[Job, ...]
    copies: tuple[Copies, ...]

    @classmethod
    def of(cls, reqs, recs: Mapping[int, Recomputation]) -> PrefillBatch:
        """The batch of ``reqs`` (the round's, warm-only ones included) under ``recs``
        (request id -> its recomputation)."""
        copies = tuple(tuple(r.plan.copies) + (recs[r.id].copies if r.id in recs else ())
                       for r in reqs if r.plan is not None)
        own = tuple(r for r in reqs if not r.warm_only)
        return cls(own, tuple(recs[r.id].job if r.id in recs else r.plan.job for r in own), copies)


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
