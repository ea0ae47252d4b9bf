"""The model runner: runs the forwards the scheduler decided, and nothing else.

It turns prefill jobs into one varlen forward (metadata packed and sent to the device in one
copy, short single-sequence prefills replayed from CUDA graphs), makes a ``PrefillBatch``'s
re-rotated page copies before its jobs, launches decode steps from the device-resident decode
state and picks their tokens (``Sampler``: one batched pick on the device per step). Where
the requests of a decode step hold the same pages (the hot documents), it plans shared-chunk
attention (``lazyllm.kernels.grouping``) so each shared page is read once per step; the plan
is made again only when the batch's rows change or a row outgrows it. It never admits, frees
or finishes a request: it calls nothing in the scheduler or the output.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from lazyllm.kernels.grouping import plan_groups
from lazyllm.kernels.options import KernelOptions

from ...cache.store import PagePool
from ...intmath import cdiv
from ...model.attention import AttentionMetadata
from ..metrics import EngineMetrics
from ..pinned import PinnedTurns
from ..request import Job, Request, TableEntry, entry_table, pack_tables, slot_of
from ..step import DecodeBatch, PrefillBatch
from .cuda_graphs import GraphRunner, PrefillGraphs, SharedPlanBuffers
from .decode_state import DecodeState
from .sampler import Sampler


@dataclass
class DecodeStep:
    """A launched decode step: its requests in row order, its logits ``(B, vocab)`` and their
    argmax ``(B,)`` on the device (overwritten by the next step of the same graph bucket),
    the requests riding along with no page (``dead``, by ``id``), when it was staged, and,
    once ``ModelRunner.pick`` has run, its tokens on their way to the host
    (``(buffer, event)``)."""

    reqs: list
    logits: torch.Tensor
    argmax: torch.Tensor
    t_launch: float
    overlapped: bool = False  # launched while the step before it was still unread
    dead: frozenset = frozenset()
    picks: tuple | None = None
    margins_dev: torch.Tensor | None = None  # each row's top-2 margin on the device (``GraphRunner.margins``)
    margins: torch.Tensor | None = None  # and on the host, copied by ``pick`` where a row is watched


def budget_groups(sizes: list[int], budget: int) -> list[list[int]]:
    """Consecutive indices of ``sizes`` in groups whose sum stays within ``budget`` (a group
    holds at least one): the forwards a list of jobs (or passes) is split into."""
    out: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i, size in enumerate(sizes):
        if cur and n + size > budget:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += size
    if cur:
        out.append(cur)
    return out


class ModelRunner:
    """Forwards of one model over one page pool (engine thread only); the warm-up's shapes
    of it in ``lazyllm.engine.warmup.shapes.RunnerShapes``."""

    supports_shared = True  # shared-chunk decode (a runner that ships metadata elsewhere says no)
    supports_mixed = True  # mixed steps (``run_mixed``; the same)
    SHARED_EXTEND = 4  # pages a row may grow by before its shared-chunk plan is made again
    # the shared-chunk path runs a step only where it saves at least this share of the step's
    # page reads: below it the per-request kernel's repeated reads hit L2 and it is the faster
    # (the measured crossover: BENCHMARKS.md, "GPU: shared-chunk attention"); a system prompt
    # shared by requests over their own documents saves a few percent
    SHARED_MIN_SAVED = 0.6
    # nor with fewer rows than this: per decode step on the H100 (closed loops, shared decode
    # on or off by a coin per step), below 16 rows the grouped kernel's extra work was not paid
    # back (1.10-1.36x the step at 1-12 rows); from 17 rows, 0.66-0.96x
    SHARED_MIN_BATCH = 16

    def __init__(self, model, pool: PagePool, *, rerotate_copy, max_batch_tokens: int, max_batch_size: int,
                 cuda_graphs: bool, metrics: EngineMetrics):
        self.model, self.pool = model, pool
        self.device = model.device
        self.rerotate_copy = rerotate_copy
        self.max_batch_tokens = max_batch_tokens
        self.metrics = metrics
        max_entries = cdiv(model.spec.max_context, pool.page_size) + 2
        att, spec = model.attention, model.spec
        # context calibration (LazyLLM(context_temperature=, context_lse_scale=)): every step
        # carries each sequence's document range
        self.calibrated = att.calibrated
        self.decode_state = DecodeState(max_batch_size, max_entries, self.device, ctx_ranges=self.calibrated)
        # no CUDA graphs where a layer's attention reads the batch layout on the host (the
        # torch reference backend)
        graphs = cuda_graphs and model.graph_capturable
        self.shared = None
        # shared-chunk decode where the backend has it for this model and pool (its step plan
        # then picks the grouped kernel for the steps this runner finds sharing pages)
        if self.supports_shared and att.shared_decode(spec.head_dim, pool.page_size):
            opts = att.options or KernelOptions()
            self.shared = SharedPlanBuffers(max_batch_size, max_entries, spec.num_heads, spec.head_dim, self.device,
                                            members_per_item=opts.shared_members, pages_per_item=opts.shared_pages)
        self._shared_state: tuple | None = None  # (decode state version, item bucket, rows' covered columns)
        self._arrays: dict[int, tuple] = {}  # request id -> (its table's epoch, width, entries array)
        self.graphs = GraphRunner(model, self.decode_state, pool.k, pool.v, enabled=graphs, shared=self.shared)
        self.prefill_graphs = PrefillGraphs(model, pool.k, pool.v, max_entries, self.device,
                                            pool.scratch_page * pool.page_size, enabled=graphs,
                                            ctx_ranges=self.calibrated)
        self._picks = PinnedTurns(self.device, n=max_batch_size)  # each step's tokens, on their way to the host
        self._margins = PinnedTurns(self.device, torch.float32, max_batch_size)  # and their margins, where asked
        self.sampler = Sampler(self.device)

    def graph_stats(self) -> dict:
        d, p = self.graphs, self.prefill_graphs
        return {"decode_graphs": len(d.graphs), "prefill_graphs": len(p.graphs),
                "capture_s": d.capture_s + p.capture_s}

    # -- prefill -------------------------------------------------------------------------
    def run_jobs(self, jobs: list[Job]) -> list[torch.Tensor | None]:
        """Logits of each job's last ``logit_rows`` tokens (``None`` for jobs that need
        none), from one forward, or a few capped by ``max_batch_tokens``."""
        out: list[torch.Tensor | None] = []
        for group in budget_groups([len(j.ids) for j in jobs], self.max_batch_tokens):
            out += self._forward_jobs([jobs[i] for i in group])
        return out

    def _forward_jobs(self, jobs: list[Job]) -> list[torch.Tensor | None]:
        ps = self.pool.page_size
        ids, pos, slots, cu, tables, logit_rows, ctx = [], [], [], [0], [], [], []
        for j in jobs:
            ctx.append(j.ctx or (0, 0))
            n = len(j.ids)
            ids += j.ids
            if j.positions is not None:
                pos += j.positions
                slots += j.slots
                tables.append(j.context)
            else:
                pos += range(j.start_pos, j.start_pos + n)
                slots += [slot_of(j.own_pages, i, ps) for i in range(n)]
                tables.append(j.context + entry_table(j.own_pages, n, j.start_pos, 0, ps))
            cu.append(cu[-1] + n)
            logit_rows += range(cu[-1] - j.logit_rows, cu[-1])
        self.metrics.prefill_tokens += len(ids)
        if len(jobs) == 1 and self.prefill_graphs.accepts(len(ids), len(tables[0]), jobs[0].logit_rows):
            # a short single-sequence prefill (a question over cached chunks): one graph replay
            out = self.prefill_graphs.run(ids, pos, slots, tables[0], ctx[0])
            if out is not None:  # None: the capture failed and graphs are off; run eagerly
                return [out]
        ids_t, rows, meta = self.metadata(ids, pos, slots, cu, tables, max(len(j.ids) for j in jobs), logit_rows,
                                          ctx=ctx if self.calibrated else None)
        logits = self.model.forward(ids_t, meta, self.pool.k, self.pool.v, logits_index=rows)
        out, i = [], 0
        for j in jobs:
            out.append(logits[i:i + j.logit_rows] if j.logit_rows else None)
            i += j.logit_rows
        return out

    def run_mixed(self, decode: list[Request], pieces: list) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """One forward over decode rows and prefill pieces (``mixed.Piece``): the decode rows'
        logits ``(len(decode), vocab)`` and each piece's logit rows (``None`` for none). Every
        decode row has its next token's slot claimed; its table's last entry is copied to the
        decode state on the device as a decode step would (so decode steps can follow), and the
        step reads the decode rows' tables there: host work O(rows + prefill tokens). With no
        decode row and whole jobs only, it is the prefill forward of ``run_jobs`` (a short
        single job replays its CUDA graph); the decode logits are then ``None``."""
        if not decode and all(p.start == 0 and p.last for p in pieces):
            return None, self._forward_jobs([p.job for p in pieces])
        ps = self.pool.page_size
        updates = [self.decode_state.row_update(r) for r in decode]
        ids = [r.state.generated[-1] for r in decode]
        pos = [r.state.next_pos for r in decode]
        slots = [u[2] * ps + u[5] - 1 for u in updates]
        tables = []
        ctx = [r.plan.ctx_range or (0, 0) for r in decode]
        cu, rows, max_q = list(range(len(decode) + 1)), list(range(len(decode))), 1
        for p in pieces:
            p_ids, p_pos, p_slots, table = p.inputs(ps)
            ids += p_ids
            pos += p_pos
            slots += p_slots
            tables.append(table)
            ctx.append(p.job.ctx or (0, 0))
            cu.append(cu[-1] + len(p_ids))
            rows += range(cu[-1] - p.logit_rows, cu[-1])
            max_q = max(max_q, len(p_ids))
        self.decode_state.copy_tails(updates)
        self.metrics.prefill_tokens += cu[-1] - len(decode)
        self.metrics.decode_tokens += len(decode)
        head = (len(decode), max((u[1] + 1 for u in updates), default=0))
        ids_t, rows_t, meta = self.metadata(ids, pos, slots, cu, tables, max_q, rows,
                                            ctx=ctx if self.calibrated else None, head=head)
        logits = self.model.forward(ids_t, meta, self.pool.k, self.pool.v, logits_index=rows_t)
        out, i = [], len(decode)
        for p in pieces:
            out.append(logits[i:i + p.logit_rows] if p.logit_rows else None)
            i += p.logit_rows
        return logits[:len(decode)], out

    def metadata(self, ids, pos, slots, cu, tables: list[list[TableEntry]], max_q: int, logit_rows, ctx=None,
                 head: tuple[int, int] = (0, 0)):
        """Token ids, logit rows and attention metadata of a prefill step, sent to the
        device in one copy (``ctx``: each sequence's document range, for calibration).
        ``head = (rows, width)``: the first ``rows`` sequences' tables are the decode state's
        rows on the device (``width`` columns used), ``tables`` those of the others."""
        Bd, Wd = head
        Bh = len(tables)
        B = Bd + Bh
        W = max(1, Wd, max((len(t) for t in tables), default=0))
        n, nr = len(ids), len(logit_rows)
        P = aligned_plane(Bh * W)
        planes = pack_tables(tables, W).reshape(4, Bh * W)
        host = torch.from_numpy(np.concatenate([
            np.asarray(ids, dtype=np.int64), np.asarray(pos, dtype=np.int64), np.asarray(slots, dtype=np.int64),
            np.asarray(cu, dtype=np.int64), np.asarray(logit_rows, dtype=np.int64),
            np.pad(planes, ((0, 0), (0, P - Bh * W))).ravel(),
            np.asarray(ctx if ctx is not None else [], dtype=np.int64).ravel()]))
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        o = 0

        def take(k):
            nonlocal o
            o += k
            return dev[o - k:o]

        ids_t, pos_t, slots_t, cu_t, rows_t = take(n), take(n), take(n), take(B + 1), take(nr)
        tab_t = take(4 * P).view(4, P).to(torch.int32)[:, :Bh * W].view(4, Bh, W)
        if Bd:  # the decode rows' tables first, into planes that start on 16 bytes too
            both = torch.empty((4, aligned_plane(B * W)), dtype=torch.int32, device=dev.device)[:, :B * W].view(4, B, W)
            tab_t = torch.cat([self.decode_state.tables[:, :Bd, :W], tab_t], dim=1, out=both)
        meta = AttentionMetadata(
            positions=pos_t.to(torch.int32), cu_seqlens_q=cu_t.to(torch.int32), slot_mapping=slots_t,
            block_table=tab_t[0], block_pos=tab_t[1], block_delta=tab_t[2], block_len=tab_t[3], max_seqlen_q=max_q,
            ctx_range=take(2 * B).view(B, 2).to(torch.int32) if ctx is not None else None,
        )
        return ids_t, rows_t, meta

    def make_copies(self, batch: PrefillBatch) -> None:
        """A prefill batch's page copies, request by request (each request's in one
        ``copy_pages``), before any of its jobs runs."""
        for copies in batch.copies:
            self.copy_pages(copies)

    def copy_pages(self, copies: list[tuple[int, int, int]]) -> None:
        """Make re-rotated private copies: ``(src page, dst page, delta)`` each, keys rotated
        by ``delta``, every layer with its own RoPE frequencies (one launch when all layers
        share them)."""
        if not copies:
            return
        src, dst, delta = (torch.tensor(x, dtype=torch.int32, device=self.device) for x in zip(*copies))
        m, pool = self.model, self.pool
        if len(m.inv_freqs) == 1:
            self.rerotate_copy(pool.k, pool.v, src, dst, delta, m.inv_freqs[0])
        else:
            for li, fi in enumerate(m.freq_index):
                self.rerotate_copy(pool.k[li:li + 1], pool.v[li:li + 1], src, dst, delta, m.inv_freqs[fi])
        self.metrics.copied_pages += len(copies)

    # -- the warm-up's steps (scratch page only; while no request runs) --------------------
    def dummy_decode(self, B: int, W: int) -> None:
        """Run (and capture) the decode step of batch bucket ``B`` and width bucket ``W`` with
        every row padding: no row reads a page, every K/V write goes to the scratch slot. A
        padded step zeroes the lengths of the rows it covers: only while nothing decodes."""
        self.decode_state.stage([], [], [], [], B, self.pool.scratch_page * self.pool.page_size)
        self.graphs.run(B, W, 0)

    def dummy_prefill(self, T: int, W: int, mass: int = 0) -> None:
        """Capture the short-prefill graph of token bucket ``T`` and width bucket ``W`` (or its
        attention-mass twin over ``mass`` layers) over ``W`` entries naming the scratch page;
        the tokens' K/V go to the scratch slot."""
        ps, scratch = self.pool.page_size, self.pool.scratch_page
        pos = list(range(W * ps, W * ps + T))
        self.prefill_graphs.run([0] * T, pos, [scratch * ps] * T, self._scratch_table(W), mass=mass)

    def _scratch_table(self, W: int) -> list[TableEntry]:
        """A table of ``W`` entries naming the scratch page, one page after another."""
        ps, scratch = self.pool.page_size, self.pool.scratch_page
        return [TableEntry(scratch, i * ps, 0, ps) for i in range(W)]

    def dummy_copy(self, n: int) -> None:
        """A re-rotated copy of ``n`` pages, scratch page to scratch page, rotated by 0."""
        scratch = self.pool.scratch_page
        self.copy_pages([(scratch, scratch, 0)] * n)

    def dummy_key_probe(self, layer: int, W: int, n: int) -> None:
        """The key-deviation probe of ``layer`` (quality recovery's) over a ``W``-entry table
        naming the scratch page, for a shortlist of ``n`` tokens."""
        ps, scratch = self.pool.page_size, self.pool.scratch_page
        pos = list(range(W * ps, W * ps + n))
        ids_t, _, meta = self.metadata([0] * n, pos, [scratch * ps] * n, [0, n], [self._scratch_table(W)], n, [])
        self.model.probe_keys_paged(ids_t, meta, self.pool.k, self.pool.v, layer)

    def dummy_mass(self, B: int, W: int, layers: int) -> None:
        """An eager attention-mass pass over ``layers`` layers (quality recovery's question
        pass for a round of requests) of ``B`` one-token sequences, each over ``W`` entries
        naming the scratch page; their K/V go to the scratch slot. Many sequences make the
        mass kernels run with the key range unsplit, as a large round's pass does."""
        ps, scratch = self.pool.page_size, self.pool.scratch_page
        ids_t, _, meta = self.metadata([0] * B, [W * ps] * B, [scratch * ps] * B, list(range(B + 1)),
                                       [self._scratch_table(W)] * B, 1, [])
        self.model.attention_mass(ids_t, meta, self.pool.k, self.pool.v, layers=layers)

    # -- decode --------------------------------------------------------------------------
    def launch_decode(self, batch: DecodeBatch) -> DecodeStep:
        """Stage and launch the forward of the decode step the scheduler decided (``batch``:
        its rows, each with its next token's slot claimed in its last page, those whose
        input is the unread step's pick on the device, those that ride along with no page);
        ``pick`` then chooses its tokens."""
        reqs, pending, dead = list(batch.reqs), batch.pending, batch.dead
        ps = self.pool.page_size
        state = self.decode_state
        updates, ids, src, pos, slots = [], [], [], [], []
        W = 0
        scratch = self.pool.scratch_page * ps
        for r in reqs:
            if r.id in dead:
                slots.append(scratch)
                updates.append((state.max_batch, 0, 0, 0, 0, 0))  # the dump row
                W = max(W, r.alloc.width)
            else:
                u = state.row_update(r)  # (row, col, page, pos, delta, len): the slot just claimed
                updates.append(u)
                slots.append(u[2] * ps + u[5] - 1)
                W = max(W, u[1] + 1)
            i = pending.get(r.id, -1)
            src.append(i)  # its token: step n's pick of that row, still on the device
            ids.append(r.state.generated[-1] if i < 0 else 0)
            pos.append(r.state.next_pos + (i >= 0))
        B = len(reqs)
        t_step = time.perf_counter()
        Bp, Wp = self.graphs.batch_bucket(B), self.graphs.width_bucket(W)
        S = self._shared_bucket(reqs) if self.shared is not None else 0
        # the graph loads the staged inputs, runs the forward and the argmax
        state.stage(updates, ids, pos, slots, Bp, scratch, src=src if pending else None)
        logits, argmax, margins = self.graphs.run(Bp, Wp, S)
        self.metrics.decode_steps += 1
        self.metrics.shared_decode_steps += S > 0
        self.metrics.decode_tokens += B
        return DecodeStep(reqs, logits[:B], argmax[:B], t_step, overlapped=bool(pending), dead=frozenset(dead),
                          margins_dev=None if margins is None else margins[:B])

    def pick(self, step: DecodeStep) -> list[tuple[Request, Exception]]:
        """Choose a launched step's tokens on the device and start their copy to the host.
        Greedy unconstrained batches take the graph's argmax; any other batch runs the
        ``Sampler`` over the step's logits (masks of constrained rows applied after the
        forward) and its picks replace the argmax as the next step's inputs. Called after the
        step before it was read (so constraints have accepted every earlier token), while
        the GPU still runs this step's forward. Returns the requests whose constraint failed
        (to be finished with the error; their token is dropped)."""
        B = len(step.reqs)
        rows = [None if r.id in step.dead or r.state.row is None or r.state.finish_reason is not None else r
                for r in step.reqs]
        picks = step.argmax
        if not self.sampler.plain_greedy(rows):
            picks = self.sampler.pick(step.logits, rows)
            self.decode_state.next_ids[:B].copy_(picks)
        if step.margins_dev is not None and any(r is not None and r.state.watched for r in rows):
            k = self._margins.take(B)  # adaptive recompute's window: the margins go with the tokens
            step.margins = self._margins.bufs[k][:B]
            step.margins.copy_(step.margins_dev, non_blocking=True)
            self._margins.record(k)
        step.picks = self._picks_to_host(picks, B)
        return self.sampler.failed if picks is not step.argmax else []

    def first_picks(self, reqs: list[Request], logits: list[torch.Tensor]) -> list[int]:
        """The first token of each of ``reqs`` (after their prefill) from its logits row
        ``(vocab,)``, in one batched pick; the requests whose constraint failed are left in
        ``self.sampler.failed``."""
        self.sampler.failed = []
        rows = torch.stack(logits)
        picks = rows.argmax(dim=-1) if self.sampler.plain_greedy(reqs) else self.sampler.pick(rows, reqs)
        return picks.tolist()

    def _shared_bucket(self, reqs: list[Request]) -> int:
        """The item bucket of the shared-chunk plan for this step's rows (0: no page is
        shared, or the plan does not fit: the per-request kernel serves the step). The plan
        is kept while the rows stay the same and no row outgrows the columns it covers."""
        st = self.decode_state
        cur = self._shared_state
        if cur is not None and cur[0] == st.version and all(r.alloc.width <= cur[2][r.state.row] for r in reqs):
            return cur[1]
        live = {r.id for r in st.rows}
        for k in [k for k in self._arrays if k not in live]:
            del self._arrays[k]
        plan = None
        if len(st.rows) >= self.SHARED_MIN_BATCH:
            tables = [self._table_array(r) for r in st.rows]
            plan = plan_groups(tables, members_per_item=self.shared.members_per_item,
                               pages_per_item=self.shared.pages_per_item, extend=self.SHARED_EXTEND,
                               width=st.max_entries)
            self.metrics.shared_plans += plan is not None
            if plan is not None and plan.saved_reads < self.SHARED_MIN_SAVED * sum(len(t) for t in tables):
                plan = None
        if plan is None:  # nothing (worth) sharing, or too few rows: valid until the rows change
            self._shared_state = (st.version, 0, [1 << 30] * len(st.rows))
            return 0
        bucket = self.shared.upload(plan)
        self._shared_state = (st.version, bucket, plan.covered.tolist() if bucket else [1 << 30] * len(st.rows))
        return bucket

    def _table_array(self, r: Request) -> np.ndarray:
        """``r``'s table as an ``(entries, 4)`` array (page, pos, delta, len), kept per request
        and extended as its table grows while decoding (within one ``Allocation.epoch``
        entries are only appended; a table of a new epoch, after preemption, is read whole)."""
        alloc = r.alloc
        n = alloc.width
        got = self._arrays.get(r.id)
        if got is not None and got[0] == alloc.epoch and got[1] == n:
            return got[2]
        fresh = got is None or got[0] != alloc.epoch or got[1] > n
        start = 0 if fresh else got[1]
        new = pack_tables([alloc.entries(start)], n - start)[:, 0].T
        arr = new if fresh else np.concatenate([got[2], new])
        self._arrays[r.id] = (alloc.epoch, n, arr)
        return arr

    def _picks_to_host(self, picks: torch.Tensor, B: int):
        """Start copying a step's tokens to the host (the graph overwrites its argmax at the
        next step of its bucket); returns ``(buffer, event)`` for ``read_picks``."""
        k = self._picks.take()
        buf = self._picks.bufs[k][:B]
        buf.copy_(picks[:B], non_blocking=True)
        self._picks.record(k)
        return buf, self._picks.events[k]

    @staticmethod
    def read_picks(step: DecodeStep) -> list[int]:
        """The step's token per row, once the GPU has produced it."""
        buf, ev = step.picks
        if ev is not None:
            ev.synchronize()
        return buf.tolist()


def aligned_plane(entries: int) -> int:
    """Room for one int32 plane of ``entries`` table entries such that the next plane also
    starts on 16 bytes. Triton specializes a kernel on whether each pointer argument is
    16-byte aligned: with planes packed end to end, a table whose size is not a multiple of
    4 entries would hand the kernels pointers the warm-up never compiled for (a request then
    waits for a compile)."""
    return -(-entries // 4) * 4
