"""Ready means fast: warm-up, Triton's kernel cache, and the kernels compiled after ready.

Triton compiles a kernel the first time it meets a new specialization: a new value of a
``constexpr`` (the launcher's key-tile loop, tiles, split-K on or off, a sliding window...), an
integer argument that starts or stops being 1 or a multiple of 16 (split counts, table widths,
strides), or a pointer of another dtype or alignment. A compile is slow (a load from Triton's
disk cache much less so; BENCHMARKS.md, time to ready), and a CUDA graph captured for a new
batch or width bucket costs a forward and the capture. Without a warm-up the first requests
pay for all of it while they wait.

``warm_up(engine, make_request)`` (``LazyLLM.warmup``) runs, on CUDA, everything the engine can
launch for this model and pool before the first request. It chooses no shape itself; it asks
the parts that own them:

- the model runner, through ``RunnerShapes`` (``shapes.py``, made with it): its CUDA graph
  captures (the decode step of every batch bucket at every table-width bucket it covers, the
  short prefills of every token bucket; an empty step needs no request and compiles what a
  full one does, as the kernels specialize on shapes, never on the tokens), and the token
  counts of synthetic requests whose launch plans differ, found by asking the launcher
  (``launch_variants``);
- recovery: its attention-mass passes and its eager launches at the shapes requests leave open
  (``Recovery.warm_launches``);
- the front door (``make_request``: ``InputProcessor.synthetic``): the synthetic requests,
  which run through the real engine (so they cannot drift from what serving launches): chunk
  prefills, batched questions, a question longer than the prefill graphs take, greedy,
  sampled and masked picks, and decode steps whose rows share pages at every batch bucket.

The engine's ``scratch`` drops what they cached and puts back the counters they moved;
``Engine.when_idle`` runs the captures between requests. On CPU the torch reference runs and
nothing compiles: the warm-up is skipped (docs/performance.md). ``Readiness`` runs it once per
engine and counts the kernels compiled after ready (``compiles.COMPILES``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from ...intmath import cdiv
from ...types import Chunk
from ..request import Request
from . import heap
from .compiles import COMPILES
from .shapes import RunnerShapes, WarmShapes

log = logging.getLogger("lazyllm")

DECODE_TOKENS = 4  # tokens per synthetic request that decodes: a few overlapped steps


class Readiness:
    """One engine's readiness: its warm-up, run once (concurrent callers wait for it, later
    ones get its report), then the engine counts as ready for ``COMPILES``; the kernels
    compiled after that are ``compiled_after_ready``."""

    def __init__(self):
        self._lock = threading.Lock()
        self.report: dict | None = None
        self._mark: int | None = None  # COMPILES.after_ready when the engine became ready

    def warm(self, engine, make_request: Callable[..., Request], progress: bool) -> dict:
        """The warm-up's report: ``warm_up(engine, make_request)`` the first time."""
        with self._lock:
            if self.report is None:
                try:
                    self.report = warm_up(engine, make_request, progress)
                finally:  # a warm-up that failed leaves an engine that serves, more slowly
                    if self._mark is None:
                        self._mark = COMPILES.mark_ready()
            return dict(self.report)

    def begin(self, warm: Callable[[], object] | None) -> None:
        """At construction: run ``warm`` (the owner's warm-up, which comes back to ``warm``
        with its engine and request maker), or with ``None`` count as ready at once."""
        if warm is not None:
            warm()
        else:
            self.skip()

    def skip(self) -> None:
        """Ready without a warm-up (``warmup=False``)."""
        with self._lock:
            if self._mark is None:
                self._mark = COMPILES.mark_ready()

    @property
    def ready(self) -> bool:
        return self._mark is not None

    @property
    def compiled_after_ready(self) -> int:
        mark = self._mark
        return 0 if mark is None else COMPILES.after_ready - mark

    def close(self) -> None:
        with self._lock:
            if self._mark is not None:
                COMPILES.mark_closed()
                self._mark = None


# -- synthetic requests --------------------------------------------------------------------
class _AllowAll:
    """A token constraint that allows every token: the sampler's masked path."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].fill_(-1)

    def accept(self, token: int) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


_CHUNK = Chunk("(a warm-up chunk of random tokens)", id="warm-up")


class _Requests:
    """Builds (through the front door's ``make_request``), submits and awaits synthetic
    requests of exact token counts (random ids from the vocabulary's middle, so no special
    token)."""

    def __init__(self, engine, make_request: Callable[..., Request], vocab_size: int, seed: int = 0):
        self.engine, self.make_request = engine, make_request
        self.rng = np.random.default_rng(seed)
        self.lo, self.hi = min(vocab_size // 4, 1000), max(vocab_size // 4 + 1, vocab_size - 1000)
        self.prefix = self.ids(8)
        self.sent = 0

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(self.lo, self.hi, size=n).tolist()

    def make(self, chunks: list[list[int]], question: int | list[int], max_new_tokens: int = 1, *,
             constraint=None, **sampling) -> Request:
        q = self.ids(question) if isinstance(question, int) else question
        return self.make_request(self.prefix, chunks, q, _CHUNK, max_new_tokens, constraint=constraint, **sampling)

    def run(self, reqs: list[Request]) -> None:
        """Submit ``reqs`` together and wait for each; a failure is logged, not raised (the
        warm-up then covers less, and the engine serves what it can)."""
        for r in reqs:
            self.engine.submit(r)
        self.sent += len(reqs)
        for r in reqs:
            while True:
                kind, val = r.events.get()
                if kind == "error":
                    log.warning("a warm-up request failed: %r", val)
                if kind in ("done", "error"):
                    break


# -- the plan: what the owners list --------------------------------------------------------
def _capture_stages(engine, runner: RunnerShapes, context_pages: int) -> list[tuple[str, Callable[[], None]]]:
    """The runner's graph captures and recovery's eager launches, each run between requests."""
    out = [(label, lambda fn=fn: engine.when_idle(fn))
           for label, fn in runner.warm_captures(context_pages, engine.recovery.mass_passes())]
    if engine.recovery.enabled:
        out.append(("recovery", lambda: engine.when_idle(engine.recovery.warm_launches)))
    return out


def _request_stages(engine, runner: RunnerShapes, shapes: WarmShapes,
                    gen: _Requests) -> list[tuple[str, Callable[[], None]]]:
    """Synthetic requests of the runner's ``WarmShapes`` through the engine: chunk prefills of every
    differing launch plan, batched questions, a question past the prefill graphs, the sampler's
    paths, shared decode at each batch bucket the pool holds (recovery and copies run where the
    configuration has them)."""
    ps = shapes.page_size
    out: list[tuple[str, Callable[[], None]]] = []
    for n in shapes.prefill_lengths:
        out.append(("prefill", lambda n=n: gen.run([gen.make([gen.ids(n)], 8)])))
    for b, n, c in shapes.questions:
        chunk = gen.ids(c)
        out.append(("questions", lambda b=b, n=n, c=chunk: gen.run([gen.make([c], n) for _ in range(b)])))
    shared = [gen.ids(4 * ps), gen.ids(4 * ps + ps // 2)]
    out.append(("prefill", lambda: gen.run([gen.make(shared, shapes.long_question)])))
    many = shapes.many_chunk_tokens
    out.append(("prefill", lambda: gen.run([gen.make([gen.ids(many) for _ in range(8)], 8)])))
    V = engine.runner.model.spec.vocab_size
    mixed = [dict(), dict(temperature=0.8, top_p=0.9, top_k=40, seed=1), dict(temperature=1.0, seed=2),
             dict(constraint=_AllowAll(V)), dict(constraint=_AllowAll(V), temperature=0.7, seed=3)]
    for kws in (mixed, mixed[1:3], mixed[3:4]):
        out.append(("sampling", lambda kws=kws: gen.run([gen.make(shared, 8, DECODE_TOKENS, **kw) for kw in kws])))
    # pages a request of a batch holds beside the shared ones: its own, and its copies of the
    # chunks where they are not shared (block: re-rotated copies; full attention: its prompt;
    # recovery: private copies of the pages it recomputes)
    own = cdiv(len(gen.prefix) + 8 + DECODE_TOKENS, ps)
    if not engine.planner.policy.mode.shares_chunk_pages or engine.recovery.enabled:
        own += sum(cdiv(len(c), ps) + 1 for c in shared)
    for B in runner.warm_decode_batches(own):
        out.append(("shared decode", lambda B=B: gen.run([gen.make(shared, 8, DECODE_TOKENS) for _ in range(B)])))
    return out


def warm_up(engine, make_request: Callable[..., Request], progress: bool = True, *, on_cpu: bool = False,
            freeze_heap: bool | None = None) -> dict:
    """Run the warm-up (module docstring) on ``engine``, its synthetic requests made by
    ``make_request`` (the front door's ``InputProcessor.synthetic``); returns what it did:
    ``seconds``, ``kernels_compiled`` (Triton specializations compiled or loaded from its
    cache), ``decode_graphs`` / ``prefill_graphs`` captured, ``capture_s``, ``requests``, and
    ``skipped`` (``"cpu"``, or ``None`` when it ran). ``on_cpu``: run the synthetic requests on
    CPU anyway (to test it, or to measure what it would bring there). ``freeze_heap`` (default:
    on CUDA): once it has run, what is alive moves to the garbage collector's permanent
    generation (``lazyllm.engine.warmup.heap``), so no full collection walks the model and the
    libraries again while serving; ``heap_frozen`` in the report counts those objects."""
    t0 = time.perf_counter()
    if engine.device.type != "cuda" and not on_cpu:
        return {"skipped": "cpu", "seconds": 0.0, "kernels_compiled": 0, "decode_graphs": 0, "prefill_graphs": 0,
                "capture_s": 0.0, "requests": 0, "heap_frozen": 0}
    compiled0, g0 = COMPILES.compiled, engine.graph_stats()
    gen = _Requests(engine, make_request, engine.runner.model.spec.vocab_size)
    try:
        runner = RunnerShapes(engine.runner)
        context = runner.warm_context_tokens()
        shapes = runner.warm_shapes(context)
        stages = (_capture_stages(engine, runner, cdiv(context, shapes.page_size) + 2)
                  + _request_stages(engine, runner, shapes, gen))
    except Exception as e:  # noqa: BLE001  (a model or backend the planning does not know)
        log.warning("the warm-up could not be planned (%r); the first requests will compile", e)
        stages = []
    _run_stages(engine, stages, progress)
    g1 = engine.graph_stats()
    report = {"skipped": None, "seconds": time.perf_counter() - t0, "kernels_compiled": COMPILES.compiled - compiled0,
              "decode_graphs": g1["decode_graphs"] - g0["decode_graphs"],
              "prefill_graphs": g1["prefill_graphs"] - g0["prefill_graphs"],
              "capture_s": g1["capture_s"] - g0["capture_s"], "requests": gen.sent, "heap_frozen": 0}
    if engine.device.type == "cuda" if freeze_heap is None else freeze_heap:
        report["heap_frozen"] = heap.freeze(engine)
    log.info("warm-up: %d Triton kernels compiled or loaded, %d decode and %d prefill CUDA graphs captured, "
             "%d requests, %.1f s", report["kernels_compiled"], report["decode_graphs"], report["prefill_graphs"],
             report["requests"], report["seconds"])
    return report


def _run_stages(engine, stages: list[tuple[str, Callable[[], None]]], progress: bool) -> None:
    """Run each stage inside the engine's ``scratch`` (each one's cached chunks dropped at once,
    so a warm-up after requests evicts none of theirs); a failing stage is logged and skipped."""
    from tqdm.auto import tqdm

    with COMPILES.warming(), engine.scratch() as drop_cached, \
            tqdm(total=len(stages), desc="warming up", unit="step", disable=not progress) as bar:
        for label, fn in stages:
            bar.set_postfix_str(label, refresh=False)
            try:
                fn()
            except Exception as e:  # noqa: BLE001  (a warm-up that covers less beats no engine)
                log.warning("warm-up step %r failed (%r); the engine serves without it", label, e)
            drop_cached()
            bar.update()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)


__all__ = ["Readiness", "warm_up", "DECODE_TOKENS"]
