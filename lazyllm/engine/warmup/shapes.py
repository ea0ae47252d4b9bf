"""What the model runner runs before the first request: its dummy steps and CUDA graph
captures, and the shapes of the synthetic requests that reach every launch plan it can make.

``RunnerShapes`` is a collaborator the warm-up driver (``driver.py``) makes with the model
runner: it reads the runner's public parts (its graphs' buckets, its pool, its decode state,
its attention backend) and calls its public dummy steps, so it chooses the shapes; the
attention backend tells which shapes compile different kernels (``launch_variants``, the
launcher's on Triton). The driver only asks for these and runs them. The runner knows
nothing of it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...intmath import cdiv

# the decode and short-prefill graphs are captured for table widths up to this many tokens of
# context (a request longer than that captures its width bucket on first use, compiling nothing
# new unless its launch plan differs, which the warm-up also covers)
WARM_CONTEXT_TOKENS = 16384


@dataclass
class WarmShapes:
    """Token counts of the warm-up's synthetic requests, chosen by the runner.

    prefill_lengths : one-chunk prefills whose launch plans differ (each also one token longer).
    questions : ``(batch, question tokens, chunk tokens)`` of batched question prefills whose
        launch plans differ (a single question short enough for a prefill graph is left out).
    long_question : a question longer than the prefill graphs take.
    many_chunk_tokens : each of eight chunks prefilled in one batch, as a cold request makes.
    page_size : tokens per page of the pool.
    """

    prefill_lengths: list[int]
    questions: list[tuple[int, int, int]]
    long_question: int
    many_chunk_tokens: int
    page_size: int


def first_of_each_variant(points, variants_of) -> list:
    """The first point (in the order given: cheapest first) of each new set of launch variants
    (``variants_of(point)``, e.g. the backend's ``launch_variants``): the points that compile something the
    earlier ones did not."""
    seen: set = set()
    out = []
    for p in points:
        new = variants_of(p) - seen
        if new:
            seen |= new
            out.append(p)
    return out


class RunnerShapes:
    """The warm-up's view of a ``ModelRunner`` (``runner``): the captures and the synthetic
    requests' shapes that reach every launch it can make. It reads the runner's ``model``,
    ``pool``, ``graphs``, ``prefill_graphs``, ``decode_state`` and ``max_batch_tokens`` and
    runs its ``dummy_decode`` and ``dummy_prefill`` steps."""

    def __init__(self, runner):
        self.runner = runner
        self.model, self.pool, self.max_batch_tokens = runner.model, runner.pool, runner.max_batch_tokens
        self.graphs, self.prefill_graphs, self.decode_state = runner.graphs, runner.prefill_graphs, runner.decode_state

    def warm_context_tokens(self) -> int:
        """Tokens of context the warm-up covers: up to ``WARM_CONTEXT_TOKENS``, within the
        model's context and a quarter of the pool."""
        ps = self.pool.page_size
        return max(ps, min(self.model.spec.max_context - 64, WARM_CONTEXT_TOKENS, self.pool.num_pages * ps // 4))

    def warm_captures(self, context_pages: int, mass_passes: list[int]) -> list[tuple[str, Callable[[], bool]]]:
        """``(label, step)`` of every graph capture: the decode step of every batch bucket at
        each width bucket, the short prefill of every token bucket at each width bucket (and
        its attention-mass twin over each of ``mass_passes`` layers, 0 for none). A step runs
        on the engine thread while no request runs and returns False when it cannot run now."""
        out: list[tuple[str, Callable[[], bool]]] = []
        if self.graphs.enabled:
            for W in self._decode_widths(context_pages):
                for B in self.graphs.batch_buckets():
                    out.append(("decode graphs", lambda B=B, W=W: self._padded_decode(B, W)))
        pg = self.prefill_graphs
        if pg.enabled:
            widths = sorted({pg.width_bucket(w) for w in range(1, min(context_pages, pg.max_entries) + 1)})
            for W in widths:
                for T in pg.token_buckets():  # questions, and recompute passes
                    for m in mass_passes if T <= 256 else [0]:  # the mass pass runs a question alone
                        out.append(("prefill graphs", lambda T=T, W=W, m=m: self.runner.dummy_prefill(T, W, m) or True))
        return out

    def warm_shapes(self, context_tokens: int) -> WarmShapes:
        """The synthetic requests' token counts for ``context_tokens`` of context."""
        ps = self.pool.page_size
        longest = max(16, min(context_tokens, self.max_batch_tokens) - 64)
        questions = [(b, n, max(1, (w - 1 - cdiv(n, ps)) * ps))  # one chunk filling the table to w entries
                     for b, n, w in self._question_points(max(3, context_tokens // ps))]
        return WarmShapes(self._prefill_lengths(longest), questions, self.prefill_graphs.max_tokens + 40,
                          max(ps, min(512, context_tokens // 8)), ps)

    def warm_decode_batches(self, pages_per_request: int) -> list[int]:
        """Batch buckets of the decode steps whose rows share pages that the pool holds with
        ``pages_per_request`` pages of each request's own (up to half the pool); larger ones are
        captured on first use."""
        out = []
        for B in self.graphs.batch_buckets():
            if B * pages_per_request > self.pool.num_pages // 2:
                break
            out.append(B)
        return out

    # -- shapes --------------------------------------------------------------------------
    def _padded_decode(self, B: int, W: int) -> bool:
        """The padded decode step, only while no row decodes (a padded step zeroes the lengths
        of the rows it covers)."""
        if self.decode_state.rows:
            return False
        self.runner.dummy_decode(B, W)
        return True

    def _variants(self, batch: int, max_seqlen_q: int, width: int, row_stride: int, plane: int | None = None):
        return self.model.attention.launch_variants(self.model, self.pool.k, self.pool.v, batch, max_seqlen_q,
                                                    width, row_stride, plane)

    def _decode_widths(self, context_pages: int) -> list[int]:
        """Width buckets of the decode graphs: every one up to ``context_pages``, then the wider
        ones whose launch plans differ at some batch bucket."""
        g, st = self.graphs, self.decode_state
        buckets = sorted({g.width_bucket(w) for w in range(1, st.max_entries + 1)})
        near = [w for w in buckets if w <= g.width_bucket(context_pages)]
        far = [w for w in buckets if w not in near]
        if not far or self.model.attention.name != "triton":
            return near
        me, plane = st.max_entries, (st.max_batch + 1) * st.max_entries  # the decode state's table planes
        batches = g.batch_buckets()
        seen = set().union(*(self._variants(b, 1, w, me, plane) for b in batches for w in near))
        extra = []
        for w in far:
            keys = set().union(*(self._variants(b, 1, w, me, plane) for b in batches))
            if keys - seen:
                seen |= keys
                extra.append(w)
        return near + extra

    def _prefill_lengths(self, max_tokens: int) -> list[int]:
        """Token counts of one-chunk prefills whose launch plans differ (the shortest of each),
        each also one token longer (the slot list's alignment), up to ``max_tokens``."""
        ps = self.pool.page_size
        cands = sorted({int(n) for n in np.unique(np.geomspace(2, max_tokens, 48).astype(int))}
                       | {16 * ps * k for k in range(1, max_tokens // (16 * ps) + 1)})
        cands = [n for n in cands if 1 < n <= max_tokens]
        if self.model.attention.name != "triton":
            return [cands[0], cands[len(cands) // 2], cands[-1]]
        chosen = first_of_each_variant(cands, lambda n: self._variants(1, n, cdiv(n, ps), cdiv(n, ps)))
        return sorted({m for n in chosen for m in (n, n + 1) if m <= max_tokens})

    def _question_points(self, max_pages: int) -> list[tuple[int, int, int]]:
        """``(batch, question tokens, table width)`` of batched question prefills (several
        requests' questions over cached chunks in one eager forward, as arrivals that come
        together get) whose launch plans differ, the cheapest of each."""
        if self.model.attention.name != "triton":
            return [(2, 40, min(8, max_pages)), (3, 300, min(40, max_pages))]
        widths = sorted({w for b in (2, 4, 8, 16, 32, 64, 128, 256) for w in (b - 1, b, b + 1) if 2 < w <= max_pages})
        graph_max = self.prefill_graphs.max_tokens if self.prefill_graphs.enabled else 0
        points = [(b, n, w) for w in widths for n in (16, 40, 64, 100, 200, 300, 600) for b in (1, 2, 3, 4, 6, 8, 16)
                  if (b > 1 or n > graph_max) and b * n <= self.max_batch_tokens and cdiv(n, self.pool.page_size) < w]
        points.sort(key=lambda p: p[0] * p[1] + p[2])
        return first_of_each_variant(points, lambda p: self._variants(p[0], p[1], p[2], p[2]))


__all__ = ["RunnerShapes", "WarmShapes", "WARM_CONTEXT_TOKENS"]
