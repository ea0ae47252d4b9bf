"""The engine: one worker thread that owns the model and the KV pool.

Callers on any thread (or event loop) submit requests and read events from a per-request
queue. Each step of the worker:

1. drops cancelled and timed-out requests;
2. admits waiting requests (``Scheduler.admit``), each planned by the ``KVPlanner`` under
   the reuse policy: cached entries pinned, missing ones reserved, private pages taken;
3. prefills, batched across the admitted requests (``ModelRunner.run_jobs``): shared
   prefixes, then missing chunks (each distinct chunk once), then the round's own jobs (each
   request's suffix, or whole prompt in the full-attention modes) as a ``PrefillBatch`` of the
   plans and recovery's ``Recomputation`` values (``step.py``), its re-rotated copies first;
   picks each request's first token (``Sampler``, one batched pick), starts it decoding at
   its plan's ``next_pos`` and hands the token out (``OutputProcessor``);
4. decodes one token for every running request, together (``ModelRunner.launch_decode``),
   optionally launching step ``n + 1`` before reading step ``n``;
5. retires finished requests (``Scheduler.retire``: unpin, free) before handing out their
   results.

With ``mixed_steps`` on, steps 3 and 4 become one forward under a token budget
(``scheduling.MixedSteps``). The rooms it calls (each a package with what it owns):
``scheduling``, ``kv``, ``running``, ``recovery``, ``warmup``; and ``output``, ``request``.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from ..cache.disk import DiskKVStore
from ..cache.disk_tier import DiskTier
from ..cache.store import ChunkStore
from ..config import EngineConfig
from ..errors import LazyLLMError, RequestCancelled
from .kv.planner import KVPlanner, PendingEntry
from .metrics import EngineMetrics
from .output import OutputProcessor
from .recovery.recompute import Recovery
from .request import Request
from .running.model_runner import DecodeStep, ModelRunner
from .scheduling.mixed import MixedSteps
from .scheduling.scheduler import Scheduler
from .step import DecodeBatch, PrefillBatch

__all__ = ["Engine"]

log = logging.getLogger("lazyllm")


class _Call:
    """A function to run on the engine thread between steps (``Engine.call``)."""

    def __init__(self, fn):
        self.fn, self.done, self.result, self.error = fn, threading.Event(), None, None

    def run(self):
        try:
            self.result = self.fn()
        except Exception as e:  # handed back to the caller
            self.error = e
        self.done.set()

    def wait(self):
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.result


class Engine:
    """Runs requests on ``model`` over ``store``'s page pool, on its own thread.

    Parameters
    ----------
    model : a ``LlamaFamilyModel``.
    tokenizer : its tokenizer (for the final text of non-streaming requests).
    store : the chunk store; its pool holds every page.
    config : the validated options (``lazyllm.config.EngineConfig``): reuse, chunk context,
        prefill tokens per forward, quality recovery, overlapped decode.
    fingerprint : the model fingerprint, part of every cache key.
    eos_ids : token ids that end a request.
    max_batch_size : requests decoding together.
    cuda_graphs : replay decode steps and short prefills from CUDA graphs (CUDA only, and only
        where the model's attention can be captured).
    rerotate_copy : the attention backend's re-rotating page copy (block copies, recovery).
    probe_layer : the layer whose keys recovery's key deviation compares (``Recovery``).
    disk : optional ``DiskKVStore``, a persistent tier for chunk KV.
    bridge_tokens : a bridge packet's trailer length: these last tokens of every chunk are
        recomputed per request (``Recovery``); 0 without a bridge packet.
    runner_cls : the model runner's class (``ModelRunner``; tensor parallelism plugs in
        ``tp_runner.TensorParallelRunner``, which broadcasts what it runs).
    """

    def __init__(self, model, tokenizer, store: ChunkStore, config: EngineConfig, *, fingerprint: str,
                 eos_ids: set[int], max_batch_size: int = 256, cuda_graphs: bool = True, rerotate_copy=None,
                 probe_layer: int = 1, disk: DiskKVStore | None = None, runner_cls: type[ModelRunner] = ModelRunner,
                 bridge_tokens: int = 0):
        self.model = model
        self.store = store
        self.pool = store.pool
        self.device = model.device
        self.metrics = EngineMetrics()  # every part counts into it; readers may index it like a dict
        self.disk = disk  # optional DiskKVStore: chunk KV that survives restarts
        self.disk_tier = DiskTier(disk, self.pool) if disk is not None else None
        self.save_to_disk = True  # off inside ``scratch`` (synthetic chunks never reach the disk tier)
        self.config = config
        max_batch_tokens = config.max_batch_tokens
        self.planner = KVPlanner(store, config.reuse, config.chunk_context, fingerprint, self.disk_tier, self.metrics)
        self.runner = runner_cls(model, self.pool, rerotate_copy=rerotate_copy, max_batch_tokens=max_batch_tokens,
                                  max_batch_size=max_batch_size, cuda_graphs=cuda_graphs, metrics=self.metrics)
        self.decode_state = self.runner.decode_state
        self.graphs = self.runner.graphs
        self.scheduler = Scheduler(self.planner, self.decode_state, max_batch_tokens=max_batch_tokens,
                                   max_batch_size=max_batch_size, metrics=self.metrics)
        self.recovery = Recovery(
            self.runner, self.planner, first_tokens=config.recompute_first_tokens, ratio=config.recompute_ratio,
            selection=config.recompute_selection, selection_depth=config.recompute_selection_depth,
            probe_layer=probe_layer, metrics=self.metrics, bridge_tokens=bridge_tokens,
            exact_at_home=self.planner.exact_at_home,
            escalate_below=config.escalate_below, escalate_tokens=config.escalate_tokens)
        # decode steps carry their margins where a request may escalate after its first token
        self.runner.graphs.margins = config.escalate_below > 0 and config.escalate_tokens > 1
        self.output = OutputProcessor(tokenizer, eos_ids, model.spec.max_context, self.metrics)
        self.inbox: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stop = False
        # (batch, seconds) of the most recent decode steps, the host's wall time from the step's
        # inputs to its sampled tokens: the time per output token at each batch size, free of
        # the prefills that interleave with decoding while requests arrive
        self.decode_step_log: collections.deque = collections.deque(maxlen=4096)
        # Overlapped decode (see _decode): on by default where decode runs from CUDA graphs
        # (there the host's per-step work is what it hides); elsewhere a step is synchronous
        # anyway. Token for token the same as one step at a time (tests/engine/test_async_decode.py).
        self.async_decode = self.graphs.enabled if config.overlap_decode is None else config.overlap_decode
        self._inflight: DecodeStep | None = None
        self._last_read: tuple[float, int] | None = None
        # mixed steps (``scheduling/mixed.py``): decode rows and prefill pieces in one forward per step
        self.mixed = (MixedSteps(self, config.step_token_budget)
                      if config.mixed_steps and self.runner.supports_mixed else None)

    # -- public, any thread ----------------------------------------------------------
    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self) -> list[Request]:
        return self.scheduler.waiting

    def submit(self, req: Request | _Call) -> Request | _Call:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop = False
                self._thread = threading.Thread(target=self._loop, name="lazyllm-engine", daemon=True)
                self._thread.start()
        self.inbox.put(req)
        return req

    def call(self, fn):
        """Run ``fn()`` on the engine thread between steps and return its result."""
        return self.submit(_Call(fn)).wait()

    def when_idle(self, fn: Callable[[], bool], timeout_s: float = 600.0) -> None:
        """Run ``fn()`` on the engine thread once no request waits or runs (requests served
        meanwhile come first), again until it returns True (it could run)."""
        deadline = time.perf_counter() + timeout_s

        def idle() -> bool:
            return not self.scheduler.running and not self.scheduler.waiting and fn()

        while not self.call(idle):
            if time.perf_counter() > deadline:
                raise TimeoutError("the engine never became idle for a warm-up step")
            time.sleep(0.01)

    @contextmanager
    def scratch(self) -> Iterator[Callable[[], None]]:
        """Work that leaves no trace (the warm-up's synthetic requests): nothing it computes
        reaches the disk tier, and at the end the entries it cached are dropped and the cache
        counters, metrics and decode step log are as before. Yields a function that drops
        what it cached so far (so that it evicts none of the callers' entries)."""
        store = self.store
        saved = self.call(lambda: (store.mark(), self.metrics.snapshot(), list(self.decode_step_log)))
        self.save_to_disk = False
        try:
            yield lambda: self.call(lambda: store.drop_except(saved[0].keys))
        finally:
            self.call(lambda: self._restore(saved))
            self.save_to_disk = True

    def _restore(self, saved) -> None:
        mark, metrics, steps = saved
        self.store.rollback(mark)
        self.metrics.restore(metrics)
        self.decode_step_log.clear()
        self.decode_step_log.extend(steps)

    def graph_stats(self) -> dict:
        """CUDA graphs captured so far (decode and short prefills) and the host seconds spent
        capturing them: a request that meets a new batch or width bucket waits for one."""
        return self.runner.graph_stats()

    def clear_cache(self) -> int:
        """Evict every unpinned cached entry; returns how many were evicted."""
        return self.call(self.store.clear_unpinned)

    def flush_disk(self) -> None:
        """Wait until every queued disk write has finished."""
        if self.disk_tier is not None:
            self.disk_tier.flush()

    def close(self) -> None:
        self.flush_disk()
        self._stop = True
        self.inbox.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- worker ------------------------------------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stop:
            idle = not sched.running and not sched.waiting
            try:
                item = self.inbox.get() if idle else self.inbox.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                if isinstance(item, _Call):
                    item.run()
                else:
                    sched.waiting.append(item)
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = None
            if self._stop:
                break
            try:
                self._step()
            except Exception as e:  # never let one bad step kill the engine
                log.exception("engine step failed")
                for r in list(sched.running):
                    self.finish(r, error=e)
        for r in sched.running + sched.waiting:
            self.finish(r, error=LazyLLMError("engine closed"))

    def _step(self) -> None:
        self._drop_cancelled()
        if self.mixed is not None:
            self.mixed.step()
            self._note_peak_pages()
            return
        admitted, failed = self.scheduler.admit()
        for r, e in failed:
            self.finish(r, error=e)
        self._note_peak_pages()
        t0 = time.perf_counter()
        if admitted:
            try:
                self._prefill(admitted)
            except Exception as e:
                log.exception("prefill failed")
                if self.device.type == "cuda" and isinstance(e, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                self.prefill_failed(admitted, e)
        t1 = time.perf_counter()
        decoding = bool(self.decode_state.rows)
        if decoding:
            self.decode_or_fail()
        self._note_peak_pages()
        # where the engine thread's time goes (a prefill waits for its first tokens; a decode
        # step, with overlap, for the step before it)
        m, t2 = self.metrics, time.perf_counter()
        m.prefill_s += t1 - t0 if admitted else 0.0
        m.decode_s += t2 - t1 if decoding else 0.0

    def decode_or_fail(self) -> None:
        """One decode step; when it fails, every request it decoded fails with the error."""
        decoding = list(self.decode_state.rows)
        try:
            self._decode()
        except Exception as e:
            log.exception("decode failed")
            for r in decoding:
                self.finish(r, error=e)

    def prefill_failed(self, reqs: list[Request], e: Exception) -> None:
        """The prefill of ``reqs`` failed: each one not yet decoding is retried alone (a bad
        request then fails only itself), or fails when it was alone."""
        for r in reqs:
            if r.state.row is not None or r.state.finish_reason is not None or r not in self.scheduler.running:
                continue  # already prefilled and decoding, or finished
            if len(reqs) > 1:
                self.scheduler.requeue(r, solo=True)
            else:
                self.finish(r, error=e)

    def _note_peak_pages(self) -> None:
        used = self.pool.num_pages - self.pool.num_free
        if used > self.metrics.peak_pages:
            self.metrics.peak_pages = used

    def _drop_cancelled(self) -> None:
        now = time.perf_counter()
        for r in list(self.scheduler.waiting) + list(self.scheduler.running):
            if r.deadline is not None and now > r.deadline and not r.cancelled.is_set():
                r.cancelled.set()
                r.state.finish_reason = "timeout"
            if r.cancelled.is_set() and not (self.mixed is not None and self.mixed.holds(r)):
                timed_out = r.state.finish_reason == "timeout"
                self.finish(r, error=RequestCancelled("timed out" if timed_out else "cancelled"))

    # -- prefill ---------------------------------------------------------------------
    def _prefill(self, reqs: list[Request]) -> None:
        self._last_read = None  # the next decode interval includes this prefill: not a step time
        for stage in self.planner.take_pending():
            if stage:
                # On failure the entries stay not-ready and are discarded when the
                # failed requests release them, so no half-written KV is ever found.
                self.runner.run_jobs([p.job for p in stage])
                self.stage_ready(stage)
        batch = self.before_own(reqs)
        self.after_own(list(batch.reqs), self.runner.run_jobs(list(batch.jobs)) if batch.reqs else [])

    def stage_ready(self, stage: list[PendingEntry]) -> None:
        """A stage's entries are computed: later lookups may use them (and the disk tier
        keeps them, outside ``scratch``)."""
        for p in stage:
            self.store.mark_ready(p.entry)
        if self.disk_tier is not None and self.save_to_disk:
            self.disk_tier.save([p.entry for p in stage])

    def before_own(self, reqs: list[Request]) -> PrefillBatch:
        """Once the entries ``reqs`` read are in the pool: recovery's recomputations (their
        counts recorded by the plans), the round's ``PrefillBatch`` of those and the plans,
        its re-rotated copies made; warm-only requests are done. Returns the batch to run."""
        recs = self.recovery.apply_round([r for r in reqs if not r.warm_only])  # one selection for the round
        for r in reqs:
            if r.id in recs:
                r.plan.recomputed(recs[r.id])
        batch = PrefillBatch.of(reqs, recs)
        self.runner.make_copies(batch)
        for r in reqs:
            if r.warm_only:
                r.state.first_token_time = time.perf_counter()
                r.state.finish_reason = "warm"
                self.finish(r)
        return batch

    def after_own(self, own: list[Request], logits: list) -> None:
        """The own jobs of ``own`` ran (``logits``: each one's logit rows): requeue those whose
        first answer token the reuse left undecided (``_escalate``), pick every other
        generating request's first token, score the scoring ones, start decoding."""
        own, logits = self._escalate(own, logits)
        gen = [(r, lg[-1]) for r, lg in zip(own, logits) if r.score is None]
        # every generating request's first token, in one batched pick
        firsts = dict(zip((r.id for r, _ in gen), self.runner.first_picks(*zip(*gen)))) if gen else {}
        failed = {r.id: e for r, e in self.runner.sampler.failed} if gen else {}
        for r, lg in zip(own, logits):
            self.planner.after_prefill(r)
            r.plan.prefilled()
            if r.score is not None:
                result = self.output.score(r, lg)
                self.scheduler.retire(r)
                self.output.done_score(r, result)
                continue
            r.state.preempted, r.state.next_pos = False, r.plan.next_pos  # it decodes from the prompt's end
            if r.id in failed:
                self.finish(r, error=failed[r.id])
                continue
            self._emit(r, firsts[r.id])
            if r.state.finish_reason is None and r in self.scheduler.running:
                self.decode_state.attach(r)

    def _escalate(self, own: list[Request], logits: list) -> tuple[list[Request], list]:
        """Adaptive recompute: the requests whose first answer token recovery finds
        undecided (``Recovery.first_escalations``) are escalated (``Scheduler.escalate``);
        returns the requests that go on, and their logits."""
        low = self.recovery.first_escalations(own, logits)
        for i in low:
            self.scheduler.escalate(own[i])
        keep = [i for i in range(len(own)) if i not in low]
        return [own[i] for i in keep], [logits[i] for i in keep]

    # -- decode ----------------------------------------------------------------------
    def _decode(self) -> None:
        """One token for every decoding request. Host work is O(batch): each request
        changes one table entry; the tables themselves stay on the device.

        Overlapped (``async_decode``): while step ``n`` runs on the GPU, the host stages and
        launches step ``n + 1``'s forward, whose token ids come from step ``n``'s picks on the
        device, then reads step ``n``'s tokens and hands them out (constraints accept them),
        then fills step ``n + 1``'s token masks and sampling inputs and enqueues its pick
        (``ModelRunner.pick``), all while step ``n + 1``'s forward runs; the GPU never waits
        for the host's bookkeeping. A request that stops at step ``n`` (EOS, a stop string, a
        complete constraint, cancellation, its length limit) has one wasted token computed in
        step ``n + 1``, which is dropped (at its length limit into the scratch slot). Sampled
        draws depend only on each request's seed and token index, so they are the same
        overlapped or not."""
        inflight = self._inflight
        if inflight is not None and not self.async_decode:
            self._read_step(inflight)
            inflight = self._inflight = None
        # requests whose latest token is still in the unread step: row -> its row there
        pending = {} if inflight is None else {r.id: i for i, r in enumerate(inflight.reqs)}
        # of those, the ones that reach a limit with that token ride along as dead rows
        dead = DecodeBatch.dead_rows(self.decode_state.rows, pending, self.model.spec.max_context)
        if inflight is not None and dead and all(r.id in dead for r in self.decode_state.rows):
            # every row ends with the token in flight: a step now would compute only dropped
            # tokens, and the next request's prefill would queue behind it on the GPU (its
            # TTFT would then include that step)
            self._inflight = None
            self._read_step(inflight)
            return
        # pages first: a request whose last page is full needs a new one; if the pool is
        # exhausted, the most recently started requests are preempted
        batch = self.scheduler.decode_batch(pending, dead)
        if not batch.reqs:
            if inflight is not None:
                self._read_step(inflight)
                self._inflight = None
            return
        step = self.runner.launch_decode(batch)
        if inflight is not None:
            self.metrics.overlapped_steps += 1
            self._inflight = None
            self._read_step(inflight)  # step n's tokens, while step n + 1 runs
        for r, e in self.runner.pick(step):
            self.finish(r, error=e)  # its constraint failed: its token is dropped
        if self.async_decode:
            self._inflight = step
        else:
            self._inflight = None
            self._read_step(step)

    def settle_inflight(self) -> None:
        """Before a mixed forward: read the overlapped decode step in flight, if any."""
        self._last_read = None
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._read_step(step)

    def _read_step(self, step: DecodeStep) -> None:
        """Hand out a launched step's tokens (waits for it on the GPU)."""
        picks = self.runner.read_picks(step)
        now = time.perf_counter()
        B = len(step.reqs)
        if step.overlapped and self._last_read is not None and self._last_read[1] == B:
            # back-to-back overlapped steps: the interval between their results is the step
            self.decode_step_log.append((B, now - self._last_read[0]))
        elif not step.overlapped:
            self.decode_step_log.append((B, now - step.t_launch))
        self._last_read = (now, B)
        margins = step.margins.tolist() if step.margins is not None else [None] * B
        for r, tok, m in zip(step.reqs, picks, margins):
            if r.state.row is None:
                continue  # finished, cancelled or preempted after the step was launched
            self.decoded(r, tok, m)

    def decoded(self, r: Request, tok: int, margin: float | None) -> None:
        """A decode step's token for ``r``, handed out; or, where ``r`` is inside its
        adaptive-recompute window and the step left this token undecided (``margin`` below
        ``escalate_below``), dropped, and ``r`` queued to be prefilled again with its tokens
        so far and every chunk token recomputed: it goes on as full attention."""
        if margin is not None and r.state.watched and self.recovery.low_margin(r, margin):
            self.scheduler.escalate(r)
            return
        r.state.next_pos += 1
        self._emit(r, tok)

    # -- output ----------------------------------------------------------------------
    def _emit(self, r: Request, tok: int) -> None:
        if r.cancelled.is_set():
            self.finish(r, error=RequestCancelled("cancelled"))
            return
        try:
            done = self.output.emit(r, tok)
        except LazyLLMError as e:  # its constraint rejected the token
            self.finish(r, error=e)
            return
        if done:
            self.finish(r)

    def finish(self, r: Request, error: Exception | None = None) -> None:
        """Retire ``r`` (its pages are free before the caller hears of it), then hand out
        its result or error."""
        self.scheduler.retire(r)
        if error is not None:
            self.output.fail(r, error)
        elif (follow := self.output.done(r)) is not None:
            self.submit(follow)  # its log-probabilities: the result goes out once they are scored

