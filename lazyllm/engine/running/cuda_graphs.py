"""Decode steps without per-step host work that grows with context length: CUDA graphs.

The decode state they read (``DecodeState``, the running requests' page tables on the device)
is in ``decode_state.py``.

``GraphRunner`` captures the decode step (input scatter, forward, argmax) in CUDA graphs,
one per (batch bucket, table width bucket), on first use, and replays them; padded rows
write their K/V into a scratch page that no request reads. A row's input token can come from
the previous step's argmax on the device, which lets the engine launch a step before reading
the one before it (``Engine.async_decode``).

``PrefillGraphs`` does the same for short single-sequence prefills (a question over cached
chunks).

``PinnedTurns`` (``engine/pinned.py``) gives each step's staged inputs host buffers to copy through.

``SharedPlanBuffers`` holds a shared-chunk attention plan (``lazyllm.kernels.grouping``) on
the device in fixed-size buffers, so a decode graph captured over its views replays any plan
that fits: the plan is uploaded when the batch's rows change, not per step.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from lazyllm.kernels.grouping import ITEM_FIELDS, MEMBER_FIELDS, PAGE_FIELDS, GroupPlan, GroupTensors

from ...intmath import cdiv, next_pow2
from ...model.attention import AttentionMetadata, SharedMeta
from ..pinned import PinnedTurns
from ..request import pack_tables
from .decode_state import DELTA, LEN, PAGE, POS, DecodeState
from .sampler import top2_margins

log = logging.getLogger("lazyllm")


def _capture_graph(forward, pool, reset=None):
    """``(graph, output)`` of ``forward()`` captured in a CUDA graph in memory pool ``pool``,
    after one warm-up call on a side stream (Triton compiles or loads its kernels, cuBLAS
    picks its algorithms and takes its workspace). ``reset()`` (not captured) runs before
    the warm-up call and after the capture, for state
    that ``forward`` both reads and writes."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        if reset is not None:
            reset()
        forward()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        out = forward()
    if reset is not None:
        reset()
    return g, out


class SharedPlanBuffers:
    """Device buffers of a shared-chunk decode plan (``GroupPlan``), fixed in size: items,
    pages, members (one per partial slot), each row's own columns and slots, and the float32
    scratch of the partial states. ``upload(plan, B)`` writes a plan (one copy from a pinned
    host buffer, unused items and rows zeroed) and returns its item bucket, or 0 where the
    plan does not fit (the step then runs the per-request kernel). ``meta(B, bucket)`` gives
    the views a step's attention reads (``SharedMeta``)."""

    def __init__(self, max_batch: int, max_entries: int, num_heads: int, head_dim: int, device: torch.device, *,
                 members_per_item: int, pages_per_item: int, slots_per_row: int = 32, items_per_row: int = 4):
        self.members_per_item, self.pages_per_item = members_per_item, pages_per_item
        self.max_batch, self.max_entries = max_batch, max_entries
        self.items_cap = max(64, items_per_row * max_batch)
        self.pages_cap = self.items_cap * pages_per_item
        self.slots_cap = slots_per_row * max_batch
        self.cols_cap = max_batch * max_entries
        sizes = (self.items_cap * ITEM_FIELDS, self.pages_cap * PAGE_FIELDS, self.slots_cap * MEMBER_FIELDS,
                 max_batch * 3, self.cols_cap, max_batch * 2)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        n = int(self.offsets[-1])
        self.dev = torch.zeros(n, dtype=torch.int32, device=device)
        self._host = PinnedTurns(device, torch.int32, n)
        self.part_o = torch.empty((self.slots_cap, num_heads, head_dim), dtype=torch.float32, device=device)
        self.part_lse = torch.empty((self.slots_cap, num_heads), dtype=torch.float32, device=device)
        o = self.offsets
        self.views = GroupTensors(
            items=self.dev[o[0]:o[1]].view(-1, ITEM_FIELDS), pages=self.dev[o[1]:o[2]].view(-1, PAGE_FIELDS),
            members=self.dev[o[2]:o[3]].view(-1, MEMBER_FIELDS), own=self.dev[o[3]:o[4]].view(-1, 3),
            cols=self.dev[o[4]:o[5]], parts=self.dev[o[5]:o[6]].view(-1, 2))

    def fits(self, plan: GroupPlan) -> bool:
        return (plan.n_items <= self.items_cap and len(plan.pages) <= self.pages_cap
                and plan.n_slots <= self.slots_cap and len(plan.cols) <= self.cols_cap
                and len(plan.own) <= self.max_batch)

    def bucket(self, n_items: int) -> int:
        return min(next_pow2(n_items, 16), self.items_cap)

    def upload(self, plan: GroupPlan) -> int:
        """Write ``plan`` to the device buffers; its item bucket (0: it does not fit)."""
        if not self.fits(plan):
            return 0
        k = self._host.take()
        h = self._host.arrays[k]
        h[:] = 0
        o = self.offsets
        for i, a in enumerate((plan.items, plan.pages, plan.members, plan.own, plan.cols, plan.parts)):
            flat = np.asarray(a, dtype=np.int32).ravel()
            h[o[i]:o[i] + len(flat)] = flat
        self.dev.copy_(self._host.bufs[k], non_blocking=True)
        self._host.record(k)
        return self.bucket(plan.n_items)

    def meta(self, B: int, bucket: int) -> SharedMeta:
        v = self.views
        return SharedMeta(plan=v._replace(items=v.items[:bucket], own=v.own[:B], parts=v.parts[:B]),
                          members_per_item=self.members_per_item, part_o=self.part_o, part_lse=self.part_lse)


class GraphRunner:
    """Decode steps through CUDA graphs captured per (batch, width, shared-plan) bucket: each graph loads
    the staged inputs (``DecodeState.load``), runs the forward and takes the argmax (also
    kept in ``DecodeState.next_ids`` for the next step)."""

    def __init__(self, model, state: DecodeState, k_cache, v_cache, enabled: bool,
                 shared: SharedPlanBuffers | None = None):
        self.model, self.state, self.k, self.v = model, state, k_cache, v_cache
        self.shared = shared
        self.enabled = enabled and state.device.type == "cuda"
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.pool = None
        self.capture_s = 0.0  # host time spent capturing (a step that meets a new bucket waits it)
        self.last_key: tuple[int, int, int] | None = None  # the bucket of the last step run
        # each step also computes its rows' top-2 margins (adaptive recompute's window:
        # ``escalate_tokens``), inside the graph; set before the first step
        self.margins = False

    def batch_bucket(self, B: int) -> int:
        return self._bucket(B) if self.enabled else B

    def _bucket(self, B: int) -> int:
        return min(next_pow2(B), self.state.max_batch)

    def batch_buckets(self) -> list[int]:
        """Every batch bucket a step may replay (powers of two up to the largest batch)."""
        return sorted({self._bucket(b) for b in range(1, self.state.max_batch + 1)})

    def width_bucket(self, W: int) -> int:
        # powers of two up to 64 entries, then multiples of 64: padding costs the decode
        # kernel work, each bucket costs one capture
        if not self.enabled:
            return W
        b = next_pow2(W, 16) if W <= 64 else cdiv(W, 64) * 64
        return min(b, self.state.max_entries)

    def _step(self, B: int, W: int, S: int = 0):
        st = self.state
        st.load(B)
        meta = st.metadata(B, W)
        if S:
            meta.shared = self.shared.meta(B, S)
        logits = self.model.forward(st.ids[:B], meta, self.k, self.v)
        picks = torch.argmax(logits, dim=-1)
        st.next_ids[:B].copy_(picks)
        return logits, picks, (top2_margins(logits) if self.margins else None)

    def run(self, B: int, W: int, S: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, vocab)``, their argmax ``(B,)`` and (with ``margins``) their top-2
        margins ``(B,)`` of the step staged in ``state`` (``B`` the batch bucket; rows past
        the real batch are padding; ``S``: the item bucket of the shared-chunk plan in
        ``shared``, 0 for none). All are overwritten by the next step of the same bucket."""
        self.last_key = (B, W, S)
        if not self.enabled:
            return self._step(B, W, S)
        key = (B, W, S)
        if key not in self.graphs:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            # the warm-up calls repeat the step exactly (the load is idempotent; next_ids, which
            # the step reads and then overwrites, is put back before each call and the replay)
            saved = self.state.next_ids.clone()
            t0 = time.perf_counter()
            self.graphs[key] = _capture_graph(lambda: self._step(B, W, S), self.pool,
                                              reset=lambda: self.state.next_ids.copy_(saved))
            self.capture_s += time.perf_counter() - t0
        g, out = self.graphs[key]
        g.replay()
        return out


class PrefillGraphs:
    """Single-sequence prefills of up to ``max_tokens`` new tokens through CUDA graphs.

    A warm RAG request prefills only its question (tens of tokens) over cached chunks;
    launched eagerly, that forward is ~300 kernels and its host time dwarfs the GPU time.
    A recompute pass (the question plus the chunk tokens recovery chose, hundreds of tokens
    at scattered positions) is host-bound too when eager: each layer's launches take longer
    on the host than its kernels on the GPU.
    Graphs are captured per (token bucket, table width bucket) on first use: powers of two
    from 16 to 256 tokens, then steps of ``STEP`` (padding stays under a fifth), widths as
    for decode. Padded tokens sit past ``cu_seqlens_q`` (no query row reads or is read by
    them) and write their K/V into the scratch page; only the last real token's logits are
    computed."""

    STEP = 128  # token bucket step above 256

    def __init__(self, model, k_cache, v_cache, max_entries: int, device: torch.device, scratch_slot: int,
                 enabled: bool, max_tokens: int = 1024, ctx_ranges: bool = False):
        self.model, self.k, self.v = model, k_cache, v_cache
        self.enabled = enabled and device.type == "cuda"
        self.max_tokens, self.max_entries, self.scratch_slot = max_tokens, max_entries, scratch_slot
        self.device = device
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.capture_s = 0.0
        if self.enabled:
            T = max_tokens
            self.buf = torch.zeros(3 * T + 3 + 4 * max_entries + 2, dtype=torch.long, device=device)
            self.tables = torch.zeros((4, 1, max_entries), dtype=torch.int32, device=device)
            self.pos = torch.zeros(T, dtype=torch.int32, device=device)
            self.cu = torch.zeros(2, dtype=torch.int32, device=device)
            self.ctx = torch.zeros((1, 2), dtype=torch.int32, device=device) if ctx_ranges else None

    def accepts(self, n_tokens: int, n_entries: int, logit_rows: int) -> bool:
        return self.enabled and 0 < n_tokens <= self.max_tokens and logit_rows == 1 and \
            0 < n_entries <= self.max_entries

    def token_bucket(self, n: int) -> int:
        """The padded token count of a prefill of ``n`` tokens (its graph's size)."""
        return next_pow2(n, 16) if n <= 256 else min(cdiv(n, self.STEP) * self.STEP, self.max_tokens)

    def token_buckets(self) -> list[int]:
        """Every token bucket ``run`` may capture, smallest first."""
        small = [t for t in (16, 32, 64, 128, 256) if t <= self.max_tokens]
        return small + list(range(256 + self.STEP, self.max_tokens + 1, self.STEP))

    def width_bucket(self, W: int) -> int:
        # powers of two: each new bucket costs a capture (a forward and the capture, a
        # stall for the request that meets it), while padding entries cost the prefill kernel
        # only a scan (it stops at the last real entry)
        return min(next_pow2(W, 16), self.max_entries)

    def run(self, ids, pos, slots, table, ctx=(0, 0), mass: int = 0) -> torch.Tensor | None:
        """Logits ``(1, vocab)`` of the last of ``ids``; ``table`` lists the sequence's
        ``TableEntry`` rows (cached context first, then its own pages); ``ctx``: its document
        range (with context calibration). ``mass`` > 0: instead, the attention mass each table
        slot gets from the tokens over the first ``mass`` layers, ``model.attention_mass``
        ``(1, width bucket, page_size)``
        (its first ``len(table)`` entries are the table's; the tokens' K/V are written as by
        a forward): the first pass of attention-guided recompute selection, one graph per
        bucket as for the forward. ``None`` if the graph could not be captured (graphs are
        then switched off)."""
        n, W = len(ids), len(table)
        T = self.token_bucket(n)
        Wb = self.width_bucket(W)
        pad = T - n
        tab = pack_tables([table], Wb)[:, 0]
        host = torch.from_numpy(np.concatenate([
            np.asarray(list(ids) + [0] * pad, dtype=np.int64),
            np.asarray(list(pos) + [pos[-1]] * pad, dtype=np.int64),
            np.asarray(list(slots) + [self.scratch_slot] * pad, dtype=np.int64),
            np.asarray([0, n, n - 1], dtype=np.int64), tab.ravel(), np.asarray(ctx, dtype=np.int64)])).pin_memory()
        m = host.numel()
        self.buf[:m].copy_(host, non_blocking=True)
        b = self.buf
        self.pos[:T].copy_(b[T:2 * T])
        self.cu.copy_(b[3 * T:3 * T + 2])
        self.tables[:, 0, :Wb].copy_(b[3 * T + 3:m - 2].view(4, Wb))
        if self.ctx is not None:
            self.ctx.view(-1).copy_(b[m - 2:m])
        key = (T, Wb, mass)
        if key not in self.graphs:
            t0 = time.perf_counter()
            try:
                self.graphs[key] = self._capture(T, Wb, mass)
                self.capture_s += time.perf_counter() - t0
            except Exception as e:  # an op that cannot be captured: stay correct, run eagerly
                log.warning("prefill CUDA graph capture failed (%r); prefills run eagerly from now on", e)
                self.enabled = False
                torch.cuda.synchronize()
                return None
        g, out = self.graphs[key]
        g.replay()
        return out

    def _meta(self, T: int, Wb: int) -> AttentionMetadata:
        t = self.tables
        return AttentionMetadata(
            positions=self.pos[:T], cu_seqlens_q=self.cu, slot_mapping=self.buf[2 * T:3 * T],
            block_table=t[PAGE, :, :Wb], block_pos=t[POS, :, :Wb], block_delta=t[DELTA, :, :Wb],
            block_len=t[LEN, :, :Wb], max_seqlen_q=T, ctx_range=self.ctx)

    def _capture(self, T: int, Wb: int, mass: int = 0):
        meta = self._meta(T, Wb)
        ids, rows = self.buf[:T], self.buf[3 * T + 2:3 * T + 3]
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        # the warm-up runs on the real inputs, so its K/V writes are the real ones
        if mass:
            return _capture_graph(lambda: self.model.attention_mass(ids, meta, self.k, self.v, layers=mass), self.pool)
        return _capture_graph(lambda: self.model.forward(ids, meta, self.k, self.v, logits_index=rows), self.pool)
