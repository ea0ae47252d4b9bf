"""Ready means fast: warm-up, Triton's kernel cache, and the kernels compiled after ready.

Triton compiles a kernel the first time it meets a new specialization: a new value of a
``constexpr`` (the launcher's key-tile loop, tiles, split-K on or off, a sliding window...), an
integer argument that starts or stops being 1 or a multiple of 16 (split counts, table widths,
strides), or a pointer of another dtype or alignment. A compile takes seconds (a load from
Triton's disk cache, tens of milliseconds), and a CUDA graph captured for a new batch or width
bucket costs a forward and the capture. Without a warm-up the first requests pay for all of
it while they wait.

``warm_up(llm)`` (``LazyLLM.warmup``) runs, on CUDA, everything the engine can launch for this
model and pool before the first request:

- the decode step of every batch bucket at every table-width bucket up to
  ``WARM_CONTEXT_TOKENS`` (plus the wider widths whose launch plan differs, found by asking the
  launcher's own ``plan_launch``), each captured in its CUDA graph: an empty step (every row
  padding) needs no request and compiles what a full one does, as the kernels specialize on
  shapes, never on the tokens;
- the short-prefill graphs of every token bucket at those widths (and the attention-mass
  graphs where recovery selects by attention);
- small synthetic requests through the real engine (so they cannot drift from what serving
  launches): chunk prefills of the lengths whose launch plans differ (again from
  ``plan_launch``), a question longer than the prefill graphs take, decode steps whose rows
  share pages at every batch bucket (the grouped shared-chunk kernel), greedy, sampled and
  masked picks, and whatever recovery and re-rotated copies the configuration runs;
- recovery's eager launches at the shapes requests leave open (page copies of 1, 16 and 17
  pages; the key-deviation probe at short and long shortlists and table widths on and off a
  multiple of 16).

The engine's ``scratch`` drops what it cached and puts back the counters it moved. On CPU the
torch reference runs and nothing compiles: the warm-up is skipped (docs/performance.md).
The runner owns the dummy steps and captures (``ModelRunner.dummy_*``) and the launcher the
specializations that tell launch plans apart (``launcher.specialization``); this module only
chooses the shapes and asks them. ``Readiness`` runs it once per engine and counts the
kernels compiled after ready (``compiles.COMPILES``).
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from ..intmath import cdiv
from ..types import Chunk
from .compiles import COMPILES
from .request import Request

log = logging.getLogger("lazyllm")

# the decode and short-prefill graphs are captured for table widths up to this many tokens of
# context (a request longer than that captures its width bucket on first use, compiling nothing
# new unless its launch plan differs, which the warm-up also covers)
WARM_CONTEXT_TOKENS = 16384
DECODE_TOKENS = 4  # tokens per synthetic request that decodes: a few overlapped steps


class Readiness:
    """One engine's readiness: its warm-up, run once (concurrent callers wait for it, later
    ones get its report), then the engine counts as ready for ``COMPILES``; the kernels
    compiled after that are ``compiled_after_ready``."""

    def __init__(self):
        self._lock = threading.Lock()
        self.report: dict | None = None
        self._mark: int | None = None  # COMPILES.after_ready when the engine became ready

    def warm(self, llm, progress: bool) -> dict:
        with self._lock:
            if self.report is None:
                try:
                    self.report = warm_up(llm, progress)
                finally:  # a warm-up that failed leaves an engine that serves, more slowly
                    if self._mark is None:
                        self._mark = COMPILES.mark_ready()
            return dict(self.report)

    def begin(self, llm) -> None:
        """At construction: the warm-up where ``llm.config.warmup``, else ready at once."""
        if llm.config.warmup:
            llm.warmup()
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


# -- which shapes the launcher plans differently ---------------------------------------------
def _launch_keys(model, pool, batch: int, max_seqlen_q: int, width: int, row_stride: int,
                 plane: int | None = None) -> frozenset:
    """What Triton compiles for one attention launch shape, for every layer kind (window,
    RoPE table) of ``model``: the ``specialization`` of the ``LaunchPlan`` that
    ``kernels/triton/launcher.plan_launch`` (the same function the launch calls) makes. The
    page, position, delta and length tables are the planes of one int32 tensor, ``plane``
    entries apart (default ``batch * width``, an eager step's packed tables)."""
    plane = batch * width if plane is None else plane
    from lazyllm.kernels import KernelOptions
    from lazyllm.kernels.triton.launcher import plan_launch, specialization

    att, spec = model.attention, model.spec
    q = torch.empty((1, spec.num_heads, spec.head_dim), device=pool.k.device, dtype=pool.k.dtype)
    table = torch.zeros((batch, width), dtype=torch.int32, device=pool.k.device)
    opts = att.options or KernelOptions()
    keys = set()
    kinds = {(w or 0, fi) for w, fi in zip(model.windows, model.freq_index)}
    for window, fi in sorted(kinds):
        inv = model.inv_freqs[fi]
        p = plan_launch(q, pool.k[0], pool.v[0], table, inv, batch, max_seqlen_q, inv.numel() > 0,
                        att.batch_invariant, att.padding_finite, opts, window, att.calibrated)
        keys.add(specialization(p, width, row_stride, plane))
    return frozenset(keys)


def _cover(points, keys_of) -> list:
    """The first point (in the order given: cheapest first) of each new set of launch keys."""
    seen: set = set()
    out = []
    for p in points:
        new = keys_of(p) - seen
        if new:
            seen |= new
            out.append(p)
    return out


def _decode_widths(runner, context_pages: int) -> list[int]:
    """Width buckets of the decode graphs: every one up to ``context_pages``, then the wider
    ones whose launch plans differ at some batch bucket."""
    g = runner.graphs
    buckets = sorted({g.width_bucket(w) for w in range(1, runner.decode_state.max_entries + 1)})
    near = [w for w in buckets if w <= g.width_bucket(context_pages)]
    far = [w for w in buckets if w not in near]
    if not far or runner.model.attention.name != "triton":
        return near
    st = runner.decode_state
    me, plane = st.max_entries, (st.max_batch + 1) * st.max_entries  # the decode state's table planes
    batches = runner.graphs.batch_buckets()
    seen = set().union(*(_launch_keys(runner.model, runner.pool, b, 1, w, me, plane) for b in batches for w in near))
    extra = []
    for w in far:
        keys = set().union(*(_launch_keys(runner.model, runner.pool, b, 1, w, me, plane) for b in batches))
        if keys - seen:
            seen |= keys
            extra.append(w)
    return near + extra


def _prefill_lengths(runner, max_tokens: int) -> list[int]:
    """Token counts of one-chunk prefills whose launch plans differ (the shortest of each),
    each also one token longer (the slot list's alignment), up to ``max_tokens``."""
    ps = runner.pool.page_size
    cands = sorted({int(n) for n in np.unique(np.geomspace(2, max_tokens, 48).astype(int))}
                   | {16 * ps * k for k in range(1, max_tokens // (16 * ps) + 1)})
    cands = [n for n in cands if 1 < n <= max_tokens]
    if runner.model.attention.name != "triton":
        return [n for n in (cands[0], cands[len(cands) // 2], cands[-1])]
    chosen = _cover(cands, lambda n: _launch_keys(runner.model, runner.pool, 1, n, cdiv(n, ps), cdiv(n, ps)))
    return sorted({m for n in chosen for m in (n, n + 1) if m <= max_tokens})


def _question_points(runner, max_pages: int) -> list[tuple[int, int, int]]:
    """``(batch, question tokens, table width)`` of batched question prefills (several
    requests' questions over cached chunks in one eager forward, as arrivals that come
    together get) whose launch plans differ, the cheapest of each; a single question of at
    most ``prefill_graphs.max_tokens`` tokens replays a graph instead and is left out."""
    if runner.model.attention.name != "triton":
        return [(2, 40, min(8, max_pages)), (3, 300, min(40, max_pages))]
    widths = sorted({w for b in (2, 4, 8, 16, 32, 64, 128, 256) for w in (b - 1, b, b + 1) if 2 < w <= max_pages})
    graph_max = runner.prefill_graphs.max_tokens if runner.prefill_graphs.enabled else 0
    points = [(b, n, w) for w in widths for n in (16, 40, 64, 100, 200, 300, 600) for b in (1, 2, 3, 4, 6, 8, 16)
              if (b > 1 or n > graph_max) and b * n <= runner.max_batch_tokens and cdiv(n, runner.pool.page_size) < w]
    points.sort(key=lambda p: p[0] * p[1] + p[2])
    return _cover(points, lambda p: _launch_keys(runner.model, runner.pool, p[0], p[1], p[2], p[2]))


# -- direct captures (engine thread, engine idle) ---------------------------------------------
def _idle(engine) -> bool:
    """No request is waiting or running. (An overlapped decode step may still be unread: its
    rows all finished, its tokens already copied out, nothing reads its outputs again.)"""
    return not engine.scheduler.running and not engine.scheduler.waiting


def _empty_decode(engine, B: int, W: int) -> bool:
    """The runner's padded decode step of batch bucket ``B`` and width bucket ``W``, while no
    request decodes; ``False`` when it could not run now."""
    if not _idle(engine) or engine.decode_state.rows:
        return False
    engine.runner.dummy_decode(B, W)
    return True


def _empty_prefill(engine, T: int, W: int, mass: int) -> bool:
    """The runner's short-prefill capture of token bucket ``T`` and width bucket ``W``, while
    the engine is idle."""
    if not _idle(engine):
        return False
    engine.runner.dummy_prefill(T, W, mass)
    return True


def _recovery_launches(engine) -> bool:
    """Recovery's eager launches whose shapes the synthetic requests do not pin down: page
    copies, and the layer-1 key-deviation probe (over the cached table as it is: no width
    bucket) where recovery selects tokens by it."""
    if not _idle(engine):
        return False
    runner, rec = engine.runner, engine.recovery
    runner.dummy_copies()
    if engine.config.recompute_ratio > 0 and rec.probe_layer == 1 and hasattr(runner.model, "probe_keys_paged"):
        runner.dummy_key_probes(1)
    return True


def _on_engine(engine, fn, timeout_s: float = 600.0) -> None:
    """``fn()`` on the engine thread once it is idle (requests served meanwhile come first)."""
    deadline = time.perf_counter() + timeout_s
    while not engine.call(fn):
        if time.perf_counter() > deadline:
            raise TimeoutError("the engine never became idle for a warm-up capture")
        time.sleep(0.01)


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
    """Builds, submits and awaits synthetic requests of exact token counts (random ids from
    the vocabulary's middle, so no special token)."""

    def __init__(self, llm, seed: int = 0):
        self.llm, self.engine = llm, llm.engine
        self.rng = np.random.default_rng(seed)
        V = llm.model.spec.vocab_size
        self.lo, self.hi = min(V // 4, 1000), max(V // 4 + 1, V - 1000)
        self.prefix = self.ids(8)
        self.sent = 0

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(self.lo, self.hi, size=n).tolist()

    def make(self, chunks: list[list[int]], question: int | list[int], max_new_tokens: int = 1, *,
             constraint=None, **sampling) -> Request:
        q = self.ids(question) if isinstance(question, int) else question
        return self.llm.inputs.synthetic(self.prefix, chunks, q, _CHUNK, max_new_tokens, constraint=constraint,
                                         **sampling)

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


# -- the plan ------------------------------------------------------------------------------
def _graph_stages(llm, context_pages: int) -> list[tuple[str, object]]:
    """The direct captures: decode graphs (every batch bucket at each width bucket) and
    short-prefill graphs (every token bucket at each width bucket)."""
    engine, cfg = llm.engine, llm.config
    runner = engine.runner
    out: list[tuple[str, object]] = []
    if runner.graphs.enabled:
        for W in _decode_widths(runner, context_pages):
            for B in runner.graphs.batch_buckets():
                out.append(("decode graphs", lambda B=B, W=W: _on_engine(engine, lambda: _empty_decode(engine, B, W))))
    pg = runner.prefill_graphs
    if pg.enabled:
        tokens = pg.token_buckets()  # questions, and recompute passes (the question and chosen chunk tokens)
        widths = sorted({pg.width_bucket(w) for w in range(1, min(context_pages, pg.max_entries) + 1)})
        mass = [0]
        if cfg.recompute_ratio > 0 and cfg.recompute_selection in ("attention", "two-stage"):
            mass.append(engine.recovery.mass_layers)  # recovery's first pass (the question's attention) replays these
        for W in widths:
            for T in tokens:
                for m in mass if T <= 256 else [0]:  # the mass pass runs a question alone
                    out.append(("prefill graphs",
                                lambda T=T, W=W, m=m: _on_engine(engine, lambda: _empty_prefill(engine, T, W, m))))
    return out


def _request_stages(llm, context_tokens: int, gen: _Requests) -> list[tuple[str, object]]:
    """Synthetic requests through the engine: chunk prefills of every differing launch plan,
    a question past the prefill graphs, the sampler's paths, shared decode at each batch
    bucket the pool holds (recovery and copies run where the configuration has them)."""
    engine = llm.engine
    runner, pool = engine.runner, engine.pool
    ps = pool.page_size
    out: list[tuple[str, object]] = []
    longest = max(16, min(context_tokens, llm.config.max_batch_tokens) - 64)
    for n in _prefill_lengths(runner, longest):
        out.append(("prefill", lambda n=n: gen.run([gen.make([gen.ids(n)], 8)])))
    for b, n, w in _question_points(runner, max(3, context_tokens // ps)):
        # one chunk filling the table to ``w`` entries beside the prefix's and the question's pages
        chunk = gen.ids(max(1, (w - 1 - cdiv(n, ps)) * ps))
        out.append(("questions", lambda b=b, n=n, c=chunk: gen.run([gen.make([c], n) for _ in range(b)])))
    shared = [gen.ids(4 * ps), gen.ids(4 * ps + ps // 2)]
    long_q = runner.prefill_graphs.max_tokens + 40
    out.append(("prefill", lambda: gen.run([gen.make(shared, long_q)])))
    many = max(ps, min(512, context_tokens // 8))  # a batched prefill of 8 chunks, as a cold request makes
    out.append(("prefill", lambda: gen.run([gen.make([gen.ids(many) for _ in range(8)], 8)])))
    if engine.recovery.enabled:
        out.append(("recovery", lambda: _on_engine(engine, lambda: _recovery_launches(engine))))
    V = llm.model.spec.vocab_size
    mixed = [dict(), dict(temperature=0.8, top_p=0.9, top_k=40, seed=1), dict(temperature=1.0, seed=2),
             dict(constraint=_AllowAll(V)), dict(constraint=_AllowAll(V), temperature=0.7, seed=3)]
    out.append(("sampling", lambda: gen.run([gen.make(shared, 8, DECODE_TOKENS, **kw) for kw in mixed])))
    out.append(("sampling", lambda: gen.run([gen.make(shared, 8, DECODE_TOKENS, **kw) for kw in mixed[1:3]])))
    out.append(("sampling", lambda: gen.run([gen.make(shared, 8, DECODE_TOKENS, **kw) for kw in mixed[3:4]])))
    # pages a request of a batch holds beside the shared ones: its own, and its copies of the
    # chunks where they are not shared (block: re-rotated copies; full attention: its prompt;
    # recovery: private copies of the pages it recomputes)
    own = cdiv(len(gen.prefix) + 8 + DECODE_TOKENS, ps)
    if engine.config.reuse != "lazy" or engine.recovery.enabled:
        own += sum(cdiv(len(c), ps) + 1 for c in shared)
    for B in runner.graphs.batch_buckets():
        if B * own > pool.num_pages // 2:
            break  # the pool cannot hold this batch: its graphs are captured on first use
        out.append(("shared decode", lambda B=B: gen.run([gen.make(shared, 8, DECODE_TOKENS) for _ in range(B)])))
    return out


def warm_up(llm, progress: bool = True, *, on_cpu: bool = False) -> dict:
    """Run the warm-up (module docstring) on ``llm``'s engine; returns what it did: ``seconds``,
    ``kernels_compiled`` (Triton specializations compiled or loaded from its cache),
    ``decode_graphs`` / ``prefill_graphs`` captured, ``capture_s``, ``requests``, and
    ``skipped`` (``"cpu"``, or ``None`` when it ran). ``on_cpu``: run the synthetic requests on
    CPU anyway (to test it, or to measure what it would bring there)."""
    engine = llm.engine
    t0 = time.perf_counter()
    if engine.device.type != "cuda" and not on_cpu:
        return {"skipped": "cpu", "seconds": 0.0, "kernels_compiled": 0, "decode_graphs": 0, "prefill_graphs": 0,
                "capture_s": 0.0, "requests": 0}
    spec = llm.model.spec
    ps = engine.pool.page_size
    context = max(ps, min(spec.max_context - 64, WARM_CONTEXT_TOKENS, engine.pool.num_pages * ps // 4))
    compiled0, g0 = COMPILES.compiled, engine.graph_stats()
    gen = _Requests(llm)
    try:
        stages = _graph_stages(llm, cdiv(context, ps) + 2) + _request_stages(llm, context, gen)
    except Exception as e:  # noqa: BLE001  (a model or backend the planning does not know)
        log.warning("the warm-up could not be planned (%r); the first requests will compile", e)
        stages = []
    from tqdm.auto import tqdm

    with COMPILES.warming(), engine.scratch() as drop_cached, \
            tqdm(total=len(stages), desc="warming up", unit="step", disable=not progress) as bar:
        for label, fn in stages:
            bar.set_postfix_str(label, refresh=False)
            try:
                fn()
            except Exception as e:  # noqa: BLE001  (a warm-up that covers less beats no engine)
                log.warning("warm-up step %r failed (%r); the engine serves without it", label, e)
            drop_cached()  # its chunks go at once, so a warm-up after requests evicts none of theirs
            bar.update()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    g1 = engine.graph_stats()
    report = {"skipped": None, "seconds": time.perf_counter() - t0, "kernels_compiled": COMPILES.compiled - compiled0,
              "decode_graphs": g1["decode_graphs"] - g0["decode_graphs"],
              "prefill_graphs": g1["prefill_graphs"] - g0["prefill_graphs"],
              "capture_s": g1["capture_s"] - g0["capture_s"], "requests": gen.sent}
    log.info("warm-up: %d Triton kernels compiled or loaded, %d decode and %d prefill CUDA graphs captured, "
             "%d requests, %.1f s", report["kernels_compiled"], report["decode_graphs"], report["prefill_graphs"],
             report["requests"], report["seconds"])
    return report
