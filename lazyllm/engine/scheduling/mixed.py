"""Mixed steps: the running requests' decode tokens and the next prefill work in one forward.

Without them (the default), an engine step prefills everything it admitted, in forwards of up to
``max_batch_tokens`` tokens, before the running requests decode their next token: a large
document stalls every request that is decoding. With ``mixed_steps`` on, an admission round's
prefill work (the entries it computes, then each request's own tokens: its question, its
recomputed chunk tokens) is spread over steps, each step one forward of at most
``step_token_budget`` tokens: one row per decoding request (its next token), the rest of the
budget the round's next prefill tokens. A job longer than what is left of the budget is cut
into pieces (chunked prefill); each piece writes its tokens' K/V where the whole job would
have, and attends to the pieces before it in the pages they wrote, so the cache ends as after
one pass.

Dependencies are kept by phases: the round's prefix entries, then its chunk entries, then
(after quality recovery and re-rotated copies) the requests' own jobs, those of the round's
``PrefillBatch`` (``Engine.before_own``); a step takes work from one phase only, so nothing
reads K/V written in the same forward by another sequence.
A job with explicit positions (recomputation) or several logit rows (scoring) is never cut;
it runs whole, alone past the budget when nothing else of the phase fits. A request's first
token is picked in the step that ends its own job. Steps with no prefill work are the
ordinary decode steps (CUDA graphs, overlapped decode), unchanged. Cancellation and timeouts
of a request still prefilling in a round take effect once its prefill is over.

``ModelRunner.run_mixed`` runs the forward; this module decides what goes in it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ...intmath import cdiv
from ..request import Job, Request, TableEntry, entry_table, slot_of
from ..running.sampler import top2_margins

if TYPE_CHECKING:
    from ..kv.planner import KVPlanner, PendingEntry
    from ..metrics import EngineMetrics
    from ..running.decode_state import DecodeState
    from ..running.model_runner import ModelRunner
    from ..step import PrefillBatch
    from .scheduler import Scheduler

log = logging.getLogger("lazyllm")


@dataclass
class Piece:
    """Tokens ``[start, end)`` of prefill job ``job`` in one mixed step."""

    job: Job
    start: int
    end: int

    @property
    def last(self) -> bool:
        """Whether it ends its job (the job's logits, if any, come from it)."""
        return self.end == len(self.job.ids)

    @property
    def logit_rows(self) -> int:
        return self.job.logit_rows if self.last else 0

    def inputs(self, page_size: int) -> tuple[list[int], list[int], list[int], list[TableEntry]]:
        """``(ids, positions, slots, table)`` of the piece: its tokens where the whole job
        puts them, over a table that holds the job's context and its tokens up to ``end``."""
        j, a, b = self.job, self.start, self.end
        if j.positions is not None:  # never cut: the job as it is
            return j.ids, j.positions, j.slots, j.context
        pos = list(range(j.start_pos + a, j.start_pos + b))
        slots = [slot_of(j.own_pages, i, page_size) for i in range(a, b)]
        own = entry_table(j.own_pages[:cdiv(b, page_size)], b, j.start_pos, 0, page_size)
        return j.ids[a:b], pos, slots, j.context + own


def splittable(job: Job) -> bool:
    """Whether a job may be cut into pieces: consecutive positions over its own pages, and at
    most one logit row (the last token's)."""
    return job.positions is None and job.logit_rows <= 1


class Phase:
    """Prefill jobs that may share a forward (no job reads another's K/V), taken in order in
    pieces under each step's budget."""

    def __init__(self, jobs: list[Job]):
        self.jobs = [j for j in jobs if j.ids]
        self.i = 0  # the first job not fully taken
        self.cursor = 0  # its tokens already taken

    @property
    def done(self) -> bool:
        return self.i >= len(self.jobs)

    def take(self, budget: int) -> list[Piece]:
        """The next pieces, at most ``budget`` tokens in all (a job that cannot be cut may
        exceed it when it would be the step's only prefill work)."""
        out: list[Piece] = []
        while not self.done and budget > 0:
            j = self.jobs[self.i]
            rest = len(j.ids) - self.cursor
            if not splittable(j):
                if out and rest > budget:
                    break
                n = rest
            else:
                n = min(rest, budget)
            out.append(Piece(j, self.cursor, self.cursor + n))
            budget -= n
            self.cursor += n
            if self.cursor == len(j.ids):
                self.i, self.cursor = self.i + 1, 0
        return out


class Round:
    """One admission round's prefill, phase by phase: the stages of entries to compute
    (``KVPlanner.take_pending``), then the requests' own jobs."""

    def __init__(self, reqs: list[Request], stages: list[list[PendingEntry]]):
        self.reqs = reqs
        self.stages = [s for s in stages if s]
        self.k = -1  # the phase under way: a stage index, len(stages) for the own jobs
        self.phase: Phase | None = None
        self.owner: dict[int, Request] = {}  # id(job) -> its request, in the own phase

    @property
    def in_stages(self) -> bool:
        return 0 <= self.k < len(self.stages)


class StepHost(Protocol):
    """What mixed steps use of the engine that makes them (``Engine``): its parts, and the
    step operations they share with its plain steps. Nothing else of the engine is read."""

    scheduler: Scheduler
    planner: KVPlanner
    runner: ModelRunner
    decode_state: DecodeState
    metrics: EngineMetrics
    device: torch.device

    def finish(self, r: Request, error: Exception | None = None) -> None: ...
    def decode_or_fail(self) -> None: ...
    def stage_ready(self, stage: list[PendingEntry]) -> None: ...
    def before_own(self, reqs: list[Request]) -> PrefillBatch: ...
    def after_own(self, own: list[Request], logits: list) -> None: ...
    def settle_inflight(self) -> None: ...
    def decoded(self, r: Request, tok: int, margin: float | None) -> None: ...
    def prefill_failed(self, reqs: list[Request], e: Exception) -> None: ...


class MixedSteps:
    """The steps of ``engine`` (the ``Engine`` that makes it, through ``StepHost``) while
    ``mixed_steps`` is on (engine thread only).

    ``trace``: set it to a list to record every mixed step as ``(decode rows, prefill
    tokens)`` (tests and benchmarks)."""

    def __init__(self, engine: StepHost, budget: int):
        self.engine, self.budget = engine, budget
        self.round: Round | None = None
        self.trace: list[tuple[int, int]] | None = None

    def holds(self, r: Request) -> bool:
        """Whether ``r`` is prefilling in the round under way (its cancellation waits)."""
        rnd = self.round
        return rnd is not None and r.state.row is None and r in rnd.reqs

    def step(self) -> None:
        """One engine step: admit a round when none is under way, then one forward with the
        decode rows and the round's next prefill pieces, or an ordinary decode step when
        there is no prefill work."""
        e = self.engine
        if self.round is None:
            admitted, failed = e.scheduler.admit()
            for r, err in failed:
                e.finish(r, error=err)
            if admitted:
                self.round = Round(admitted, e.planner.take_pending())
        pieces: list[Piece] = []
        if self.round is not None:
            try:
                self._advance()
                room = self.budget - len(e.decode_state.rows)
                if self.round is not None and room > 0:
                    pieces = self.round.phase.take(room)
            except Exception as err:
                self._fail(err, [])
                return
        t0 = time.perf_counter()
        if not pieces:
            if e.decode_state.rows:
                e.decode_or_fail()
                e.metrics.decode_s += time.perf_counter() - t0
            return
        self._mixed(pieces)
        e.metrics.prefill_s += time.perf_counter() - t0

    def _advance(self) -> None:
        """Close the finished phases: a stage's entries become ready (and go to the disk
        tier); after the last stage, recovery and copies, then the own jobs; after those, the
        round is over."""
        e, rnd = self.engine, self.round
        while rnd.phase is None or rnd.phase.done:
            if rnd.in_stages:
                e.stage_ready(rnd.stages[rnd.k])
            rnd.k += 1
            if rnd.in_stages:
                rnd.phase = Phase([p.job for p in rnd.stages[rnd.k]])
            elif rnd.k == len(rnd.stages):
                live = [r for r in rnd.reqs if r in e.scheduler.running]
                batch = e.before_own(live)
                rnd.owner = {id(j): r for r, j in zip(batch.reqs, batch.jobs)}
                rnd.phase = Phase(list(batch.jobs))
            else:
                self.round = None
                return

    def _mixed(self, pieces: list[Piece]) -> None:
        """Run one mixed forward and hand out its tokens: the decode rows' next tokens, and
        the first token of every request whose own job it ends."""
        e = self.engine
        try:
            e.settle_inflight()  # the overlapped step in flight, read first
            decode = list(e.scheduler.decode_batch({}, set()).reqs)
            logits, piece_logits = e.runner.run_mixed(decode, pieces)
        except Exception as err:
            self._fail(err, list(e.decode_state.rows))
            return
        e.metrics.mixed_steps += 1
        if self.trace is not None:
            self.trace.append((len(decode), sum(p.end - p.start for p in pieces)))
        if decode:
            picks = e.runner.first_picks(decode, list(logits))
            failed = {r.id: err for r, err in e.runner.sampler.failed}
            margins = (top2_margins(torch.stack(list(logits))).tolist() if any(r.state.watched for r in decode)
                       else [None] * len(decode))
            for r, tok, m in zip(decode, picks, margins):
                if r.state.row is None:
                    continue
                if r.id in failed:
                    e.finish(r, error=failed[r.id])
                    continue
                e.decoded(r, tok, m)
        rnd = self.round
        ended = [(rnd.owner[id(p.job)], lg) for p, lg in zip(pieces, piece_logits)
                 if p.last and id(p.job) in rnd.owner]
        if ended:
            try:
                e.after_own([r for r, _ in ended], [lg for _, lg in ended])
            except Exception as err:
                self._fail(err, [])
                return
        try:
            self._advance()
        except Exception as err:
            self._fail(err, [])

    def _fail(self, err: Exception, decode: list[Request]) -> None:
        """A mixed step failed: its decode rows fail, the round's requests still prefilling
        are retried alone (or fail, alone already), and the round is dropped."""
        e = self.engine
        log.exception("mixed step failed")
        if e.device.type == "cuda" and isinstance(err, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        for r in decode:
            e.finish(r, error=err)
        rnd, self.round = self.round, None
        if rnd is not None:
            e.prefill_failed(rnd.reqs, err)
