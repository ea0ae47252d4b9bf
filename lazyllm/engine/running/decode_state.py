"""The running requests' page tables on the device, one row per request.

``DecodeState`` keeps a copy of the running requests' page tables on the device, one row per
request: a request's row is copied from its ``Allocation`` once when it starts decoding, and
each step copies exactly one entry per request (its last page's length, or a new page). It
decides nothing in them: ``row_update`` checks that the table was not rebuilt since the copy
(its ``epoch``) and copies its last entry. Rows stay compact
(``0..B-1``), so a step's metadata is a view of the first ``B`` rows and the first ``W``
columns.
"""
from __future__ import annotations

import numpy as np
import torch

from ...model.attention import AttentionMetadata
from ..pinned import PinnedTurns
from ..request import pack_tables

# the four int planes of a table (``request.pack_tables``), in order
PAGE, POS, DELTA, LEN = range(4)


class DecodeState:
    """Device-resident decode inputs: page tables ``(4, max_batch + 1, max_entries)`` (page,
    position, delta, length planes; the last row is a dump for padded rows' updates) and the
    per-token step inputs.

    ``stage`` writes a step's host inputs into one of two pinned buffers and enqueues its copy
    to the device; ``load(n)`` scatters them (token ids, positions, KV slots, one table entry
    per request, ``cu_seqlens``). ``load`` has a fixed shape per batch bucket ``n`` and reads
    the real batch size from the device, so a CUDA graph captures it with the forward: a decode
    step is one host write, one copy and one graph launch. A row's token id can also come from
    the previous step's argmax on the device (``next_ids``), so the host can launch step
    ``n + 1`` before it has read step ``n``'s tokens (``Engine`` overlaps its bookkeeping with
    the GPU that way). Two staging buffers, so staging a step never waits for the one before."""

    def __init__(self, max_batch: int, max_entries: int, device: torch.device, ctx_ranges: bool = False):
        self.max_batch, self.max_entries, self.device = max_batch, max_entries, device
        i32 = dict(dtype=torch.int32, device=device)
        self.tables = torch.zeros((4, max_batch + 1, max_entries), **i32)
        # each row's document range [start, end) (context calibration; None: off)
        self.ctx = torch.zeros((max_batch + 1, 2), **i32) if ctx_ranges else None
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.next_ids = torch.zeros(max_batch, dtype=torch.long, device=device)  # the last step's argmax
        self.pos = torch.zeros(max_batch, **i32)
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.cu = torch.zeros(max_batch + 1, **i32)
        self._arange = torch.arange(max_batch + 1, **i32)
        self._rows = torch.arange(max_batch, **i32)
        # ids, source rows, pos, slots (n each), B, 4 indices and 4 values per row
        n = 12 * max_batch + 1
        self._host = PinnedTurns(device, n=n)
        self._dev = torch.zeros(n, dtype=torch.long, device=device)
        self.rows: list = []  # requests, in row order
        self._epochs: list[int] = []  # per row, the epoch of the request's table copied there
        self.version = 0  # changes whenever a row is attached, freed or moved

    def attach(self, r) -> None:
        """Give request ``r`` the next row and copy its whole table there (once)."""
        table = r.alloc.table
        if len(table) > self.max_entries:
            raise ValueError("page table wider than the decode state")
        row = len(self.rows)
        self.rows.append(r)
        self._epochs.append(r.alloc.epoch)
        r.state.row = row
        self.version += 1
        host = torch.from_numpy(pack_tables([table], self.max_entries)[:, 0]).to(torch.int32)
        self.tables[:, row].copy_(host.to(self.device, non_blocking=False))
        if self.ctx is not None:
            self.ctx[row].copy_(torch.tensor(r.plan.ctx_range or (0, 0), dtype=torch.int32).to(self.device))

    def detach(self, r) -> None:
        """Free ``r``'s row, moving the last row into it to keep rows compact."""
        i = r.state.row
        if i is None:
            return
        last = len(self.rows) - 1
        if i != last:
            self.tables[:, i].copy_(self.tables[:, last])
            if self.ctx is not None:
                self.ctx[i].copy_(self.ctx[last])
            moved = self.rows[last]
            self.rows[i] = moved
            self._epochs[i] = self._epochs[last]
            moved.state.row = i
        self.rows.pop()
        self._epochs.pop()
        r.state.row = None
        self.version += 1

    def row_update(self, r) -> tuple[int, int, int, int, int, int]:
        """The update of ``r``'s row for this step, ``(row, col, page, pos, delta, len)``: its
        table's last entry, the only one that changed since the last step (a slot more, or
        a new page). Raises if the table was rebuilt since its row was copied."""
        alloc, row = r.alloc, r.state.row
        if alloc.epoch != self._epochs[row]:
            raise RuntimeError("a decoding request's page table was rebuilt; its device copy is stale")
        return (row, *alloc.tail())

    def copy_tails(self, updates: list[tuple[int, int, int, int, int, int]]) -> None:
        """Copy each row's last table entry (``row_update``'s ``(row, col, page, pos, delta,
        len)``) to the device, as a decode step's ``load`` does, for a step that runs outside
        the decode graphs (a mixed step)."""
        if updates:
            u = torch.tensor(updates, dtype=torch.long).to(self.device)
            self.tables[:, u[:, 0], u[:, 1]] = u[:, 2:].T.to(torch.int32)

    def stage(self, updates: list[tuple[int, int, int, int, int, int]], ids, pos, slots, pad_to: int,
              scratch_slot: int, src=None) -> None:
        """Stage this step's inputs for ``load(pad_to)`` and enqueue their copy to the device:
        the token inputs, padded to ``pad_to`` rows (padded rows write their K/V into
        ``scratch_slot``), and the table updates (``row, col, page, pos, delta, len``, one per
        request; padded rows update the dump row). ``src[i] >= 0``: row ``i``'s token is the
        previous step's argmax of row ``src[i]`` (its ``ids[i]`` is ignored). Host work
        O(batch), whatever the context length."""
        B, n, ME = len(ids), pad_to, self.max_entries
        plane = (self.max_batch + 1) * ME
        p = self._host.take()
        h = self._host.arrays[p]
        h[:B] = ids
        h[B:n] = 0
        h[n:n + B] = -1 if src is None else src
        h[n + B:2 * n] = -1
        h[2 * n:2 * n + B] = pos
        h[2 * n + B:3 * n] = 0
        h[3 * n:3 * n + B] = slots
        h[3 * n + B:4 * n] = scratch_slot
        h[4 * n] = B
        u = np.zeros((n, 6), dtype=np.int64)
        u[:, 0] = self.max_batch  # the dump row
        if updates:
            u[:B] = np.asarray(updates, dtype=np.int64)
        base = u[:, 0] * ME + u[:, 1]
        o = 4 * n + 1
        h[o:o + 4 * n] = (base[:, None] + plane * np.arange(4)[None, :]).ravel()
        h[o + 4 * n:o + 8 * n] = u[:, 2:].ravel()
        m = 12 * n + 1
        self._dev[:m].copy_(self._host.bufs[p][:m], non_blocking=True)
        self._host.record(p)

    def load(self, n: int) -> None:
        """Device side of ``stage(..., pad_to=n)``: fixed shapes for a given ``n``, the real
        batch size read from the device (capturable in a CUDA graph)."""
        dev = self._dev
        src = dev[n:2 * n]
        ids = torch.where(src >= 0, self.next_ids.gather(0, src.clamp(min=0)), dev[:n])
        self.ids[:n].copy_(ids)
        self.pos[:n].copy_(dev[2 * n:3 * n])
        self.slots[:n].copy_(dev[3 * n:4 * n])
        B = dev[4 * n:4 * n + 1].to(torch.int32)
        o = 4 * n + 1
        self.tables.view(-1).index_put_((dev[o:o + 4 * n],), dev[o + 4 * n:o + 8 * n].to(torch.int32))
        torch.minimum(self._arange[: n + 1], B, out=self.cu[: n + 1])
        # rows past the real batch read nothing: their lengths are zeroed
        self.tables[LEN, :n].mul_((self._rows[:n] < B).to(torch.int32)[:, None])

    def metadata(self, B: int, W: int) -> AttentionMetadata:
        t = self.tables
        return AttentionMetadata(
            positions=self.pos[:B], cu_seqlens_q=self.cu[: B + 1], slot_mapping=self.slots[:B],
            block_table=t[PAGE, :B, :W], block_pos=t[POS, :B, :W], block_delta=t[DELTA, :B, :W],
            block_len=t[LEN, :B, :W], max_seqlen_q=1, ctx_range=None if self.ctx is None else self.ctx[:B],
        )
