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

A bridge packet's trailer (``lazyllm.model.packets``, ``bridge_tokens`` per chunk) is always
recomputed the same way: its tokens then attend to the prefix, every earlier chunk and their
bridges, and their own chunk, for this request only.

Recovery decides and writes nothing of the request's plan: ``Recovery.apply`` returns a
``Recomputation`` (``engine/step.py``: the replacement job, the page copies, the counts it
moves from reused to computed), which the engine puts in the step's ``PrefillBatch`` and the
plan records (``PrefillPlan.recomputed``). The private pages themselves come from the
request's ``Allocation`` (``privatize``), the holder of its pages.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from lazyllm.kernels.reference import rotate_by_delta

from ...config import register_selection, selection_names
from ...config import selection as scorer_of
from ...intmath import cdiv
from ..kv.planner import KVPlanner
from ..metrics import EngineMetrics
from ..pinned import to_device
from ..request import ChunkSpan, Job, Request, slot_of
from ..running.model_runner import ModelRunner
from ..running.sampler import top2_margins
from ..step import Recomputation
from .chunk_index import DELTA, PAGE, PROBE, ROW, SLOT, SPAN, TOK, TOKEN, ChunkIndex
from .rounds import batches, question_ids, select_round


def __getattr__(name: str):
    # ``SELECTIONS``: the registered selection names, read when asked (a benchmark may add some)
    if name == "SELECTIONS":
        return selection_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Recovery:
    """Recomputes chosen chunk tokens of a request (engine thread only)."""

    def __init__(self, runner: ModelRunner, planner: KVPlanner, *, first_tokens: int = 0, ratio: float = 0.0,
                 selection: str = "deviation", selection_depth: float = 1.0, probe_layer: int = 1,
                 metrics: EngineMetrics | None = None, exact_at_home: bool = False, bridge_tokens: int = 0,
                 escalate_below: float = 0.0, escalate_tokens: int = 1):
        """``selection_depth``: the question's attention (``question_attention``) is summed over
        the first ``ceil(selection_depth * layers)`` layers.

        ``bridge_tokens``: the last this many tokens of every chunk (a bridge packet's
        trailer) are recomputed for every request, whatever the selection.

        ``exact_at_home``: a chunk that sits where it was encoded (every entry at delta 0)
        already holds full attention's KV, so nothing of it is recomputed: true for
        ``reuse="lazy"`` with ``chunk_context="prefix"``, where chunks are encoded right after
        the shared prefix and the first chunk of a request sits there.

        ``escalate_below``: a request whose reuse pass leaves its first answer token's top-2
        probability margin below this is prefilled again with every chunk token recomputed
        (``escalates``; the engine requeues it with ``state.escalated``). ``escalate_tokens``:
        how many first answer tokens are checked (a score's first continuation rows; a
        generation's later tokens while it decodes, ``state.watched``)."""
        self.runner, self.planner = runner, planner
        self.model, self.pool = runner.model, runner.pool
        self.first_tokens, self.ratio, self.selection = first_tokens, ratio, selection
        self.bridge_tokens = bridge_tokens
        self.exact_at_home = exact_at_home
        self.escalate_below = escalate_below
        self.escalate_tokens = escalate_tokens
        n_layers = self.model.spec.num_layers
        self.probe_layer = min(probe_layer, n_layers - 1)
        self.mass_layers = max(1, min(n_layers, math.ceil(selection_depth * n_layers)))
        self._memo: dict[int, ChunkIndex] | None = None  # apply's chunk token indexes, by request id
        self.metrics = metrics if metrics is not None else EngineMetrics()

    @property
    def recovers(self) -> bool:
        """Whether every request recomputes some chunk tokens."""
        return self.first_tokens > 0 or self.ratio > 0 or self.bridge_tokens > 0

    @property
    def enabled(self) -> bool:
        """Whether any request may recompute chunk tokens (every one, or escalated ones)."""
        return self.recovers or self.escalate_below > 0

    def low_margin(self, r: Request, margin: float) -> bool:
        """Whether ``r``, decoding inside its window (``state.watched``), is escalated by its
        next token's ``margin``; past the window it is watched no more."""
        if len(r.state.generated) >= self.escalate_tokens:
            r.state.watched = False
            return False
        return margin < self.escalate_below

    def first_escalations(self, own: list[Request], logits: list) -> set[int]:
        """The indices of ``own`` (just prefilled; ``logits``: each one's logit rows) whose
        first answer token's top-2 margin is below ``escalate_below`` (a generation's last
        row; a score's lowest over its first ``escalate_tokens`` rows), in one batched
        reduction and one read; the generations that keep their answer are marked watched
        (``state.watched``) for the rest of their window."""
        check = [i for i, r in enumerate(own) if self.escalates(r)]
        if not check:
            return set()
        n = self.escalate_tokens
        rows = [logits[i][-1:] if own[i].score is None else logits[i][:n] for i in check]
        margins = [float(m.min()) for m in top2_margins(torch.cat(rows)).split([len(x) for x in rows])]
        low = {i for i, m in zip(check, margins) if m < self.escalate_below}
        for i in check:
            own[i].state.watched = n > 1 and i not in low and own[i].score is None
        return low

    def escalates(self, r: Request) -> bool:
        """Whether ``r``, just prefilled over reused chunks, is one whose first token's margin
        is to be checked: escalation is on, it has chunks that were not all at home, it was
        not escalated already and it is not a preempted request resuming."""
        if not (self.escalate_below > 0 and not r.state.escalated and r.state.resumed is None
                and r.plan is not None and r.plan.spans):
            return False
        home, lens, _ = self.budget(r)
        return bool(lens[~home].sum())

    # -- its warm-up: the launches whose shapes requests leave open -------------------------
    def mass_passes(self) -> list[int]:
        """Layers of the prefill graphs' attention-mass passes recovery replays: 0 (the plain
        graph), and ``mass_layers`` where it selects tokens by the question's attention."""
        return [0, self.mass_layers] if self.by_attention else [0]

    @property
    def by_attention(self) -> bool:
        """Whether the selection runs the question's attention-mass pass."""
        return self.ratio > 0 and self.selection in ("attention", "two-stage")

    def warm_launches(self) -> bool:
        """Run recovery's eager launches at the shapes the warm-up's requests do not pin down
        (engine thread, while no request runs): page copies of 1, 16 and 17 pages (Triton
        specializes an integer argument on being 1 and on being a multiple of 16); where it
        selects by the question's attention, a round's batched question pass (enough
        sequences that the mass kernels' key range is not split: ``num_splits`` 1); and where
        it selects by key deviation the layer-1 probe at short and long shortlists over tables
        on and off a multiple of 16 entries wide."""
        for n in (1, 16, 17):
            self.runner.dummy_copy(n)
        if self.by_attention and batches(self) and hasattr(self.runner, "dummy_mass"):
            for W in (16, 17):  # a round's question pass: its mass kernels unsplit, tables on and off 16
                self.runner.dummy_mass(_ROUND_WARM_SEQS, W, self.mass_layers)
        if self.ratio > 0 and self.probe_layer == 1 and hasattr(self.model, "probe_keys_paged"):
            for W in (64, 65):
                for n in (16, 17, 200, 1100):
                    self.runner.dummy_key_probe(1, W, n)
        return True

    def apply(self, r: Request, picked: np.ndarray | None = None) -> Recomputation | None:
        """Once the request's chunk KV is in the pool, decide how its prefill also
        recomputes the chosen chunk tokens: the ``Recomputation`` (its plan is left as it
        is), or ``None`` when nothing is recomputed. If the pool cannot give the page
        copies, the request goes ahead without recovery (``None``, counted in
        ``recovery_skipped``).
        ``picked``: the selection's picks (chunk order), made already for a whole round
        (``apply_round``); ``None``: selected here.

        On CUDA the selection runs without waiting for the device until its final pick: the
        host's index work overlaps the question's pass, and every host-to-device copy is one
        pinned, asynchronous copy."""
        plan = r.plan
        spans = plan.spans
        if not spans or not (self.recovers or r.state.escalated):
            return None
        outer = self._memo is None
        if outer:
            self._memo = {}  # the chunk token index is built once for this request
        t0 = time.perf_counter()
        try:
            return self._apply(r, plan, spans, picked)
        finally:
            if outer:
                self._memo = None
            self.metrics.selection_s += time.perf_counter() - t0

    def apply_round(self, reqs: list[Request]) -> dict[int, Recomputation]:
        """``apply`` for every request of an admission round: request id -> its
        ``Recomputation``, for those that recompute something. With one of the engine's own
        selections (``rounds.batches``) and more than one request to select for, the
        selection runs once for all of them (``select_round``: one batched question pass, one
        key probe per ``max_batch_tokens``, one read of every pick), not once per request."""
        reqs = [r for r in reqs if r.plan is not None and r.plan.spans]
        if not self.enabled or not reqs:
            return {}
        self._memo = {}
        try:
            picks: dict[int, np.ndarray] = {}
            selecting = [r for r in reqs if not r.state.escalated]  # an escalated one takes every token
            if len(selecting) > 1 and batches(self):
                t0 = time.perf_counter()
                picks = select_round(self, selecting)
                self.metrics.selection_s += time.perf_counter() - t0
            recs = {r.id: self.apply(r, picks.get(r.id)) for r in reqs}
            return {i: rc for i, rc in recs.items() if rc is not None}
        finally:
            self._memo = None

    def budget(self, r: Request) -> tuple[np.ndarray, np.ndarray, int]:
        """Per chunk of ``r``: whether it is at home (``exact_at_home``: nothing of it is
        recomputed) and its length; and how many tokens the ratio picks (0: none)."""
        spans = r.plan.spans
        home = np.array([self.exact_at_home and all(e.delta == 0 for e in s.entries) for s in spans], dtype=bool)
        lens = np.array([len(s.ids) for s in spans], dtype=np.int64)
        total, away = int(lens.sum()), int(lens[~home].sum())
        n_pick = min(away, int(math.ceil(self.ratio * total))) if self.ratio > 0 else 0
        return home, lens, n_pick

    def _pick(self, r: Request, home: np.ndarray, lens: np.ndarray, n_pick: int) -> np.ndarray:
        """The selection's ``n_pick`` chunk tokens of ``r`` (chunk order indices)."""
        if n_pick <= 0:
            return np.zeros(0, dtype=np.int64)
        at_home = torch.from_numpy(np.repeat(home, lens)) if home.any() else None
        dev = scorer_of(self.selection)(self, r, n_pick, at_home)
        if at_home is not None:
            dev = dev.masked_fill(to_device(at_home, dev.device), float("-inf"))
        top = torch.topk(dev, n_pick)
        # one read from the device: the picks and which of them scored finite
        both = torch.stack([top.indices, torch.isfinite(top.values).long()]).cpu().numpy()
        return both[0][both[1] == 1]  # never a token scored -inf

    def _apply(self, r: Request, plan, spans: list[ChunkSpan], picked: np.ndarray | None) -> Recomputation | None:
        # a chunk at home (exact_at_home) already has full attention's KV: the budget goes elsewhere
        home, lens, n_pick = self.budget(r)
        k = self.first_tokens
        if r.state.escalated:  # every token away from home: no selection to run
            picked = np.flatnonzero(~np.repeat(home, lens))
        elif picked is None:
            picked = self._pick(r, home, lens, n_pick)
        ix = self.index(r)
        span, tok = ix.host[SPAN], ix.host[TOK]
        chosen = (tok < k) & ~home[span]  # each chunk's first k tokens, unless at home
        if self.bridge_tokens:  # a bridge packet's trailer, at each chunk's end
            chosen |= (tok >= lens[span] - self.bridge_tokens) & ~home[span]
        chosen[picked] = True
        ch = np.flatnonzero(chosen)  # chunk order: by chunk, then by token
        ps = self.pool.page_size
        alloc = r.alloc
        first = np.array([s.first_entry for s in spans], dtype=np.int64)
        col_of = first[span[ch]] + tok[ch] // ps
        cols = np.unique(col_of).tolist()  # the pages holding chosen tokens, in table order
        # those that are shared: this request's private copies
        copies = alloc.privatize([c for c in cols if not alloc.owns(alloc.table[c].page)])
        if copies is None:
            self.metrics.recovery_skipped += 1
            return None
        table = alloc.table
        page_of = np.array([table[c].page for c in cols], dtype=np.int64)[np.searchsorted(cols, col_of)]
        per_span = np.bincount(span[ch], minlength=len(spans))
        reused = np.array([not s.computed_now for s in spans], dtype=bool)  # counted as reused: they are not
        S = len(plan.suffix_ids)
        ids = ix.host[TOKEN][ch].tolist() + list(plan.suffix_ids)
        positions = ix.host[ROW][ch].tolist() + list(range(plan.suffix_pos, plan.suffix_pos + S))
        slots = (page_of * ps + tok[ch] % ps).tolist() + [slot_of(plan.own, i, ps) for i in range(S)]
        job = Job(ids, plan.suffix_pos, [], list(table), logit_rows=r.logit_rows,
                  positions=positions, slots=slots, ctx=plan.ctx_range)
        return Recomputation(job, tuple(copies), reused=int(per_span[reused].sum()), computed=int(len(ch)))

    # -- the per-request chunk token index ---------------------------------------------------------
    def index(self, r: Request) -> ChunkIndex:
        """Per chunk token of ``r`` (chunk order: by chunk, then by token): where it is cached
        (page, slot in the page, the entry's delta), its position in the prompt, its slot in
        the question pass's table, its id, its chunk and its index there. Host arrays, and
        their device copy when first asked for (one pinned, asynchronous copy); built once
        per ``apply`` (or ``apply_round``)."""
        memo = self._memo
        if memo is not None and r.id in memo:
            return memo[r.id]
        ps = self.pool.page_size
        spans: list[ChunkSpan] = r.plan.spans
        off = spans[0].first_entry  # the probe table: the prefix, then each chunk's entries
        cols = []
        for ci, s in enumerate(spans):  # numpy on the host
            n = len(s.ids)
            ent = s.entries[:cdiv(n, ps)]
            ar = np.arange(n, dtype=np.int64)
            cols.append(np.stack([
                np.repeat(np.fromiter((e.page for e in ent), np.int64, len(ent)), ps)[:n], ar % ps,
                np.repeat(np.fromiter((e.delta for e in ent), np.int64, len(ent)), ps)[:n], ar + s.start,
                ar + off * ps, np.asarray(s.ids, dtype=np.int64), np.full(n, ci, np.int64), ar]))
            off += len(s.entries)
        host = np.concatenate(cols, axis=1)
        ix = ChunkIndex(host, self.pool.k.device)
        if memo is not None:  # inside apply (a benchmark's call builds it afresh)
            memo[r.id] = ix
        return ix

    def question_attention(self, r: Request) -> torch.Tensor:
        """Per chunk token (in chunk order), the attention mass the question's queries give
        it (summed over the first ``mass_layers`` layers, heads and queries) in a forward of
        the suffix over the cached prefix and chunk KV as they are (nothing recomputed yet).
        The suffix's K/V go to its own pages and are overwritten by the real pass. A score's
        continuation is not part of the question: its tokens are left out, so a score
        recomputes what a generation of those tokens would (the selection never sees the
        answer it is scored on)."""
        plan = r.plan
        probe = self.cached_table(r)
        ids = question_ids(r)
        S, pos0 = len(ids), plan.suffix_pos
        ps = self.pool.page_size
        slots = [slot_of(plan.own, i, ps) for i in range(S)]
        table = probe + self.planner.own_table(plan.own, pos0, S)
        pos = list(range(pos0, pos0 + S))
        self.metrics.prefill_tokens += S
        mass = None
        graphs = getattr(self.runner, "prefill_graphs", None)
        if graphs is not None and graphs.accepts(S, len(table), 1):
            # a question over cached chunks: one graph replay (eager, its launches cost more host time than GPU time)
            mass = graphs.run(ids, pos, slots, table, mass=self.mass_layers)
        if mass is None:
            ids_t, _, meta = self.runner.metadata(ids, pos, slots, [0, S], [table], S, [])
            mass = self.model.attention_mass(ids_t, meta, self.pool.k, self.pool.v, layers=self.mass_layers)
        # the index is built while the device runs the pass; a chunk's pages are consecutive
        # entries of the probe table from its offset on
        return mass[0].reshape(-1)[self.index(r).dev[PROBE]].float()

    @staticmethod
    def cached_table(r: Request) -> list:
        """The request's cached prefix and chunk entries as they are (nothing recomputed or
        copied yet): the question pass's and the probe's table (``_index`` holds each chunk
        token's slot in it)."""
        spans: list[ChunkSpan] = r.plan.spans
        table = list(r.plan.context[:spans[0].first_entry])  # the prefix (never shifted, never copied)
        for s in spans:  # the shared chunk pages with their rotations
            table += s.entries
        return table

    def two_stage(self, r: Request, n_pick: int, exclude: torch.Tensor | None = None) -> torch.Tensor:
        """Query-aware two-stage choice (ProphetKV-style): the question's attention over the
        cached KV shortlists ``2 * n_pick`` chunk tokens; among them, those whose cached keys
        also deviate most from full attention's (``key_deviation``) rank first, by the product
        of the two (each scaled to its maximum). Tokens off the shortlist score -inf, and so do
        the ``exclude`` ones (bool, chunk order), which take no place on it."""
        mass = self.question_attention(r)
        n_ok = mass.numel()
        if exclude is not None:  # tokens that are not to be chosen do not take shortlist places
            mass = mass.masked_fill(to_device(exclude, mass.device), float("-inf"))
            n_ok -= int(exclude.sum())  # counted on the host: no wait for the device
        cand = torch.topk(mass, min(n_ok, 2 * n_pick)).indices
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
        d = self.index(r).dev
        pages, slot_idx, deltas, rows, tokens = d[PAGE], d[SLOT], d[DELTA], d[ROW], d[TOKEN]
        idx = only if only is not None else torch.arange(rows.numel(), device=rows.device)
        idx = idx.to(rows.device).sort().values  # by position: the prefill kernels' query order
        if layer == 1 and hasattr(self.model, "probe_keys_paged"):
            full = self._probe_paged(r, rows[idx], tokens[idx], layer)
        else:
            n_head = spans[-1].start + len(spans[-1].ids)  # prefix + chunks: the suffix is not needed
            ids = torch.tensor(r.prompt_ids[:n_head], dtype=torch.long, device=self.pool.k.device)
            full = self.model.probe_keys(ids, layer)[rows[idx]]
        cached = self.pool.k[layer][pages[idx], slot_idx[idx]]
        inv = self.model.inv_freqs[self.model.freq_index[layer]]
        cached = rotate_by_delta(cached, deltas[idx], inv)
        out = torch.zeros(rows.numel(), device=cached.device)
        out[idx] = (full.float() - cached.float()).pow(2).sum(dim=(-1, -2)).sqrt()
        return out

    def _probe_paged(self, r: Request, positions: torch.Tensor, ids: torch.Tensor, layer: int) -> torch.Tensor:
        """Keys of ``layer`` under full attention for the prompt tokens ``ids`` at
        ``positions`` (device tensors, by position), from the cached K/V below it
        (``model.probe_keys_paged``); their own K/V go to the scratch slot."""
        table = self.cached_table(r)
        n = int(positions.shape[0])
        zeros = np.zeros(n, dtype=np.int64)
        slots = np.full(n, self.pool.scratch_page * self.pool.page_size, dtype=np.int64)
        _, _, meta = self.runner.metadata(zeros, zeros, slots, [0, n], [table], n, [])
        meta.positions = positions.to(torch.int32)  # the shortlist's, already on the device
        return self.model.probe_keys_paged(ids, meta, self.pool.k, self.pool.v, layer)

    def chunk_token_slots(self, r: Request) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where each chunk token of ``r`` (in chunk order, as the selections score them) is
        cached: its page, its slot in the page, its entry's delta, and its position in the
        prompt; ``(chunk tokens,)`` int64 each, on the pool's device."""
        d = self.index(r).dev
        return d[PAGE], d[SLOT], d[DELTA], d[ROW]


# sequences of the warm-up's batched question pass: past any device's SM count over its KV heads
_ROUND_WARM_SEQS = 160

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


# their form for a whole round (``rounds.select_round``)
_by_key_deviation.batched = "deviation"
_by_question_attention.batched = "attention"
_two_stage.batched = "two-stage"
