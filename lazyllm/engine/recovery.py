"""Quality recovery: recompute a few chunk tokens of a request with full context.

A chunk encoded alone never saw the other documents. Recovery recomputes, for one request
only, the first ``first_tokens`` tokens of each chunk (EPIC-style) and the ``ratio`` fraction
of chunk tokens chosen by ``selection``: ``"deviation"``, those whose early-layer keys
deviate most from full attention (CacheBlend-style), ``"attention"``, those the question
attends to most in a first pass over the cached KV, or ``"two-stage"``, a shortlist by the
question's attention ranked by attention times key deviation (ProphetKV-style). The recomputed tokens run in the same
forward as the suffix. Pages holding them are replaced, for this request only, by private
copies re-rotated to their logical positions; the shared cache is never written, so it stays
reusable by every other request.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from lazyllm.kernels.reference import rotate_by_delta

from ..config import register_selection, selection_names
from ..config import selection as scorer_of
from ..intmath import cdiv
from .kv_planner import KVPlanner
from .model_runner import ModelRunner
from .request import ChunkSpan, Job, Request, slot_of


def __getattr__(name: str):
    # ``SELECTIONS``: the registered selection names, read when asked (a benchmark may add some)
    if name == "SELECTIONS":
        return selection_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Recovery:
    """Recomputes chosen chunk tokens of a request (engine thread only)."""

    def __init__(self, runner: ModelRunner, planner: KVPlanner, *, first_tokens: int = 0, ratio: float = 0.0,
                 selection: str = "deviation", probe_layer: int = 1, metrics: dict | None = None,
                 exact_at_home: bool = False):
        """``exact_at_home``: a chunk that sits where it was encoded (every entry at delta 0)
        already holds full attention's KV, so nothing of it is recomputed: true for
        ``reuse="lazy"`` with ``chunk_context="prefix"``, where chunks are encoded right after
        the shared prefix and the first chunk of a request sits there."""
        self.runner, self.planner = runner, planner
        self.model, self.pool = runner.model, runner.pool
        self.first_tokens, self.ratio, self.selection = first_tokens, ratio, selection
        self.exact_at_home = exact_at_home
        self.probe_layer = min(probe_layer, self.model.spec.num_layers - 1)
        self.metrics = metrics if metrics is not None else {}

    @property
    def enabled(self) -> bool:
        return self.first_tokens > 0 or self.ratio > 0

    def apply(self, r: Request) -> None:
        """Once the request's chunk KV is in the pool, rewrite its plan so that its prefill
        also recomputes the chosen chunk tokens. If the pool cannot give the page copies,
        the request goes ahead without recovery (counted in ``recovery_skipped``)."""
        plan = r.plan
        spans = plan.spans
        k, ratio = self.first_tokens, self.ratio
        if not spans or (k <= 0 and ratio <= 0):
            return
        # a chunk at home (exact_at_home) already has full attention's KV: the budget goes elsewhere
        home = [self.exact_at_home and all(e.delta == 0 for e in s.entries) for s in spans]
        sel = [set() if h else set(range(min(k, len(s.ids)))) for s, h in zip(spans, home)]
        away = sum(len(s.ids) for s, h in zip(spans, home) if not h)
        if ratio > 0 and away > 0:
            total = sum(len(s.ids) for s in spans)
            n_pick = min(away, int(math.ceil(ratio * total)))
            at_home = torch.cat([torch.full((len(s.ids),), h) for s, h in zip(spans, home)]) if any(home) else None
            dev = scorer_of(self.selection)(self, r, n_pick, at_home)
            if at_home is not None:
                dev = dev.masked_fill(at_home.to(dev.device), float("-inf"))
            flat = [(ci, i) for ci, s in enumerate(spans) for i in range(len(s.ids))]
            top = torch.topk(dev, n_pick)
            for j in top.indices[torch.isfinite(top.values)].tolist():  # never a token scored -inf
                ci, i = flat[j]
                sel[ci].add(i)
        ps = self.pool.page_size
        alloc = r.alloc
        # the pages holding chosen tokens that are shared: this request's private copies
        cols = [s.first_entry + j for s, chosen in zip(spans, sel) for j in sorted({i // ps for i in chosen})]
        copies = alloc.privatize([c for c in cols if not alloc.owns(alloc.table[c].page)])
        if copies is None:
            self.metrics["recovery_skipped"] += 1
            return
        table = list(alloc.table[:len(plan.context)])
        ids, positions, slots = [], [], []
        for s, chosen in zip(spans, sel):
            for i in sorted(chosen):
                ids.append(s.ids[i])
                positions.append(s.start + i)
                slots.append(table[s.first_entry + i // ps].page * ps + i % ps)
            r.plan.recomputed_tokens += len(chosen)
            if not s.computed_now:  # these tokens were counted as reused: they are not
                r.plan.cached_tokens -= len(chosen)
                r.plan.cached_chunk_tokens -= len(chosen)
        r.plan.computed_tokens += len(ids)
        S = len(plan.suffix_ids)
        ids += plan.suffix_ids
        positions += range(plan.suffix_pos, plan.suffix_pos + S)
        slots += [slot_of(plan.own, i, ps) for i in range(S)]
        plan.copies = plan.copies + copies
        plan.job = Job(ids, plan.suffix_pos, [], list(alloc.table), logit_rows=r.logit_rows,
                       positions=positions, slots=slots, ctx=r.plan.ctx_range)

    def question_attention(self, r: Request) -> torch.Tensor:
        """Per chunk token (in chunk order), the attention mass the question's queries give
        it (summed over layers, heads and queries) in a forward of the suffix over the
        cached prefix and chunk KV as they are (nothing recomputed yet). The suffix's K/V
        go to its own pages and are overwritten by the real pass."""
        plan = r.plan
        spans: list[ChunkSpan] = plan.spans
        probe, offsets = self._cached_table(r)
        S, pos0 = len(plan.suffix_ids), plan.suffix_pos
        ps = self.pool.page_size
        slots = [slot_of(plan.own, i, ps) for i in range(S)]
        table = probe + self.planner.own_table(plan.own, pos0, S)
        ids, pos = list(plan.suffix_ids), list(range(pos0, pos0 + S))
        self.metrics["prefill_tokens"] += S
        mass = None
        graphs = getattr(self.runner, "prefill_graphs", None)
        if graphs is not None and graphs.accepts(S, len(table), 1):
            # a question over cached chunks: one graph replay (eager, its launches cost more host time than GPU time)
            mass = graphs.run(ids, pos, slots, table, mass=True)
        if mass is None:
            ids_t, _, meta = self.runner.metadata(ids, pos, slots, [0, S], [table], S, [])
            mass = self.model.attention_mass(ids_t, meta, self.pool.k, self.pool.v)
        mass = mass[0].reshape(-1)
        # a chunk's pages are consecutive entries of the probe table from its offset on
        idx = torch.cat([off * ps + torch.arange(len(s.ids)) for off, s in zip(offsets, spans)])
        return mass[idx.to(mass.device)].float()

    @staticmethod
    def _cached_table(r: Request) -> tuple[list, list[int]]:
        """The request's cached prefix and chunk entries as they are (nothing recomputed or
        copied yet), and each chunk's first entry in that table."""
        spans: list[ChunkSpan] = r.plan.spans
        table = list(r.plan.context[:spans[0].first_entry])  # the prefix (never shifted, never copied)
        offsets = []
        for s in spans:  # the shared chunk pages with their rotations
            offsets.append(len(table))
            table += s.entries
        return table, offsets

    def two_stage(self, r: Request, n_pick: int, exclude: torch.Tensor | None = None) -> torch.Tensor:
        """Query-aware two-stage choice (ProphetKV-style): the question's attention over the
        cached KV shortlists ``2 * n_pick`` chunk tokens; among them, those whose cached keys
        also deviate most from full attention's (``key_deviation``) rank first, by the product
        of the two (each scaled to its maximum). Tokens off the shortlist score -inf, and so do
        the ``exclude`` ones (bool, chunk order), which take no place on it."""
        mass = self.question_attention(r)
        if exclude is not None:  # tokens that are not to be chosen do not take shortlist places
            mass = mass.masked_fill(exclude.to(mass.device), float("-inf"))
        n_cand = min(int(torch.isfinite(mass).sum()), 2 * n_pick)
        cand = torch.topk(mass, n_cand).indices
        dev = self.key_deviation(r, only=cand).to(mass.device)
        m, d = mass[cand], dev[cand]
        score = torch.full_like(mass, float("-inf"))
        score[cand] = (m / m.max().clamp_min(1e-30)) * (d / d.max().clamp_min(1e-30))
        return score

    def key_deviation(self, r: Request, only: torch.Tensor | None = None) -> torch.Tensor:
        """Per chunk token (in chunk order), the distance between its cached keys at layer
        ``probe_layer`` and the keys full attention gives it there. ``only``: the indices
        (chunk order) of the tokens wanted; the others get 0.

        At layer 1 (the default probe) the full-attention keys come from the wanted tokens
        alone run through layer 0 over the cached layer-0 K/V, which are full attention's
        (``probe_keys_paged``); deeper probes run the whole prompt head densely."""
        spans: list[ChunkSpan] = r.plan.spans
        layer = self.probe_layer
        pages, slot_idx, deltas, rows = self.chunk_token_slots(r)
        idx = only if only is not None else torch.arange(len(rows), device=rows.device)
        idx = idx.to(rows.device).sort().values  # by position: the prefill kernels' query order
        if layer == 1 and hasattr(self.model, "probe_keys_paged"):
            full = self._probe_paged(r, rows[idx].tolist(), layer)
        else:
            n_head = spans[-1].start + len(spans[-1].ids)  # prefix + chunks: the suffix is not needed
            ids = torch.tensor(r.prompt_ids[:n_head], dtype=torch.long, device=self.pool.k.device)
            full = self.model.probe_keys(ids, layer)[rows[idx]]
        cached = self.pool.k[layer][pages[idx], slot_idx[idx]]
        inv = self.model.inv_freqs[self.model.freq_index[layer]]
        cached = rotate_by_delta(cached, deltas[idx], inv)
        out = torch.zeros(len(rows), device=cached.device)
        out[idx] = (full.float() - cached.float()).pow(2).sum(dim=(-1, -2)).sqrt()
        return out

    def _probe_paged(self, r: Request, positions: list[int], layer: int) -> torch.Tensor:
        """Keys of ``layer`` under full attention for the prompt tokens at ``positions``,
        from the cached K/V below it (``model.probe_keys_paged``); their own K/V go to the
        scratch slot."""
        table, _ = self._cached_table(r)
        n = len(positions)
        prompt = r.prompt_ids  # built on each access: read once
        ids = [prompt[p] for p in positions]
        slots = [self.pool.scratch_page * self.pool.page_size] * n
        ids_t, _, meta = self.runner.metadata(ids, positions, slots, [0, n], [table], n, [])
        return self.model.probe_keys_paged(ids_t, meta, self.pool.k, self.pool.v, layer)

    def chunk_token_slots(self, r: Request) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each chunk token of ``r`` (in chunk order, as the selections score them) is
        cached: its page, its slot in the page, its entry's delta, and its position in the
        prompt; ``(chunk tokens,)`` int64 each, on the pool's device."""
        ps = self.pool.page_size
        pages, slots, deltas, rows = [], [], [], []
        for s in r.plan.spans:  # numpy on the host, one copy to the device
            n = len(s.ids)
            ent = s.entries[:cdiv(n, ps)]
            pages.append(np.repeat(np.fromiter((e.page for e in ent), np.int64, len(ent)), ps)[:n])
            deltas.append(np.repeat(np.fromiter((e.delta for e in ent), np.int64, len(ent)), ps)[:n])
            slots.append(np.arange(n, dtype=np.int64) % ps)
            rows.append(np.arange(s.start, s.start + n, dtype=np.int64))
        host = torch.from_numpy(np.stack([np.concatenate(t) for t in (pages, slots, deltas, rows)]))
        return tuple(host.to(self.pool.k.device, non_blocking=False).unbind(0))


# The engine's selections (``recompute_selection``); ``lazyllm.config.register_selection`` adds more.
@register_selection("deviation")
def _by_key_deviation(rec: Recovery, r: Request, n_pick: int, exclude: torch.Tensor | None) -> torch.Tensor:
    """CacheBlend: the chunk tokens whose layer-``probe_layer`` keys deviate most."""
    return rec.key_deviation(r)


@register_selection("attention")
def _by_question_attention(rec: Recovery, r: Request, n_pick: int, exclude: torch.Tensor | None) -> torch.Tensor:
    """The chunk tokens the question attends to most over the cached KV."""
    return rec.question_attention(r)


@register_selection("two-stage")
def _two_stage(rec: Recovery, r: Request, n_pick: int, exclude: torch.Tensor | None) -> torch.Tensor:
    """ProphetKV: attention shortlists, attention times key deviation ranks."""
    return rec.two_stage(r, n_pick, exclude=exclude)
