"""Shared-chunk attention plans: which queries read which pages together.

A step's requests often hold the same chunk pages (the hot documents of a RAG workload),
each at its own position. Keys are stored rotated at the chunk's own positions, so a query
can be rotated into a page's frame (``R(-delta) q``, one small rotation per query and page)
and every query that holds the page can share one pass over its K/V tiles. ``plan_groups``
turns the step's page tables into *work items*: a tile of up to ``members_per_item`` queries
and a run of up to ``pages_per_item`` pages that every one of them reads. Each (item, query)
pair yields a partial softmax state (a *slot*); a query's slots are contiguous and merge by
log-sum-exp. The pages only one query reads are its *own* (the question, the generated
tokens, a chunk no other request holds); they are named by table column, so a plan stays
valid while a decode step's last page grows.

Pure NumPy; the kernel is ``lazyllm.kernels.triton.grouped`` and its plain-torch twin
``reference.grouped_attention_ref``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = ["GroupPlan", "GroupTensors", "plan_groups"]

ITEM_FIELDS = 4  # member offset, member count, page (or column) offset, page count
MEMBER_FIELDS = 4  # query index, table row, partial slot, delta (shared items)
PAGE_FIELDS = 3  # page id, stored position of its slot 0, valid slots


class GroupTensors(NamedTuple):
    """A plan's arrays as int32 tensors (see ``GroupPlan``); fixed-size buffers padded with
    zero items are valid too (an item with no member is skipped)."""

    items: Any
    pages: Any
    members: Any
    own: Any
    cols: Any
    parts: Any


@dataclass(frozen=True)
class GroupPlan:
    """Work items of shared-chunk attention (host arrays, int32).

    Shared items read their pages from the plan: ``items`` ``(n, 4)`` gives an offset into
    ``members``, the member count, an offset into ``pages`` and the page count; ``pages``
    ``(p, 3)`` the page id, the stored position of its slot 0 (the frame its keys were
    rotated in: a request's position less its delta, the same for every holder) and its
    valid slots. Every member of an item places the item's pages with one delta (runs are
    cut where a member's delta changes), so its query is rotated once per item.

    The pages only one query reads (question, generated tokens, a chunk no other request
    holds) are its *own* pages: ``own`` ``(total_q, 3)`` gives the query's table row, an
    offset into ``cols`` and a count; page, position, delta and length come from the step's
    tables at ``(row, cols[...])``. They change from step to step, so a plan stays valid while
    the tables' entries change in place, and ``extend`` lets the columns cover entries a
    row's table does not have yet. The kernel attends to a query's own pages and merges its
    shared slots in one program.

    ``members`` ``(m, 4)``: query index (row of ``q``), table row, partial slot, delta.
    ``parts`` ``(total_q, 2)``: each query's first slot and slot count (contiguous).
    ``shared_pages``: distinct pages read once for several queries; ``covered``: per table
    row, the columns the plan covers (a row whose table grows past it needs a new plan).
    """

    items: np.ndarray
    pages: np.ndarray
    members: np.ndarray
    own: np.ndarray
    cols: np.ndarray
    parts: np.ndarray
    shared_pages: int
    covered: np.ndarray

    def tensors(self, device=None) -> GroupTensors:
        """The arrays as contiguous int32 tensors (on ``device``), what the kernel and its
        reference take."""
        import torch

        return GroupTensors(*(torch.from_numpy(np.ascontiguousarray(getattr(self, n))).to(device)
                              for n in GroupTensors._fields))

    @property
    def n_items(self) -> int:
        return int(self.items.shape[0])

    @property
    def n_slots(self) -> int:
        return int(self.members.shape[0])

    @property
    def saved_reads(self) -> int:
        """Page reads the shared items save against one read per query and page: each item
        reads its pages once for all its members."""
        it = self.items
        return int(((it[:, 1] - 1) * it[:, 3]).sum()) if len(it) else 0


def plan_groups(tables: Sequence[Sequence[tuple[int, int, int, int]]], *,
                queries: Sequence[Sequence[int]] | None = None, members_per_item: int = 16,
                pages_per_item: int = 8, min_share: int = 2, extend: int = 0,
                width: int | None = None) -> GroupPlan | None:
    """The work items of one step, or ``None`` when no page is read by ``min_share``
    queries or more (nothing to share: the ordinary kernels serve the step).

    Parameters
    ----------
    tables : per table row, its entries ``(page, pos, delta, len)`` by column (padding
        columns left out).
    queries : per table row, the indices of its queries in ``q`` (default: row ``b`` has
        the one query ``b``, as in a decode step).
    members_per_item : queries per shared item (the kernel's query tile holds this many
        times the query heads per KV head).
    pages_per_item : pages per item (the key range one program reads; smaller: more
        programs and more slots to merge).
    min_share : a page read by at least this many queries is shared.
    extend : columns past each row's last one that its own pages also cover (entries the
        table will gain, read as padding until then).
    width : the tables' column count (the kernel reads columns up to it): ``extend`` stops
        there. ``None``: no limit.
    """
    if members_per_item < 1 or pages_per_item < 1 or min_share < 2 or extend < 0:
        raise ValueError("members_per_item and pages_per_item must be >= 1, min_share >= 2, extend >= 0")
    n_rows = len(tables)
    if queries is None:
        queries = [[b] for b in range(n_rows)]
    if len(queries) != n_rows:
        raise ValueError(f"{len(queries)} query lists for {n_rows} table rows")
    total_q = sum(len(qs) for qs in queries)
    rows = [np.asarray(r, dtype=np.int64).reshape(-1, 4) for r in tables]
    lens = np.array([len(r) for r in rows], dtype=np.int64)
    if not lens.sum():
        return None
    E = np.concatenate(rows)  # every entry: page, pos, delta, len
    R = np.repeat(np.arange(n_rows), lens)  # its row
    C = np.arange(len(E)) - np.repeat(np.cumsum(lens) - lens, lens)  # its column
    nq = np.array([len(qs) for qs in queries], dtype=np.int64)
    page, pos, delta, ln = E.T
    _, inv = np.unique(page, return_inverse=True)
    readers = np.bincount(inv, weights=nq[R])[inv]
    holders = np.bincount(inv)[inv]
    shared = readers >= min_share
    if not shared.any():
        return None

    # shared pages grouped by who holds them (a multiset hash of the holder rows), each
    # group's pages in the first holder's column order, one row of holders per page
    sh = np.flatnonzero(shared)
    pages_u, pinv = np.unique(page[sh], return_inverse=True)
    weights = np.random.default_rng(0x5EED).integers(1, 2**62, size=n_rows, dtype=np.uint64)
    sig = np.zeros(len(pages_u), dtype=np.uint64)
    np.add.at(sig, pinv, weights[R[sh]])  # wraps mod 2**64
    by_page = np.lexsort((C[sh], R[sh], pinv))
    first_holder = np.ones(len(sh), dtype=bool)
    first_holder[1:] = pinv[by_page][1:] != pinv[by_page][:-1]
    col0 = np.zeros(len(pages_u), dtype=np.int64)
    col0[pinv[by_page][first_holder]] = C[sh][by_page][first_holder]
    order = sh[np.lexsort((C[sh], R[sh], pinv, col0[pinv], sig[pinv]))]
    o_sig = sig[pinv[np.searchsorted(sh, order)]]
    bounds = np.flatnonzero(o_sig[1:] != o_sig[:-1]) + 1

    items, pages, members = [], [], []
    own_mask = ~shared
    shared_pages = 0
    for ent in np.split(order, bounds):
        h = int(holders[ent[0]])
        n = len(ent) // h
        rows_of = R[ent[:n * h]].reshape(n, h)
        if len(ent) != n * h or not (rows_of == rows_of[0]).all():  # a hash collision: serve as own
            own_mask[ent] = True
            continue
        ent = ent.reshape(n, h)
        shared_pages += n
        D = delta[ent]
        cut = np.ones(n, dtype=bool)
        cut[1:] = (D[1:] != D[:-1]).any(axis=1)
        run_starts = []
        for k in range(n):  # runs of one delta per holder, at most pages_per_item long
            if cut[k] or k - run_starts[-1] >= pages_per_item:
                run_starts.append(k)
        run_starts.append(n)
        e0 = ent[:, 0]
        run_pages = np.stack([page[e0], pos[e0] - delta[e0], ln[e0]], axis=1)
        for k0, k1 in zip(run_starts[:-1], run_starts[1:]):
            mem = [(qi, int(b), int(dl)) for b, dl in zip(rows_of[0], D[k0]) for qi in queries[int(b)]]
            p_off = len(pages)
            pages.extend(run_pages[k0:k1].tolist())
            for ms in range(0, len(mem), members_per_item):
                tile = mem[ms:ms + members_per_item]
                items.append((len(members), len(tile), p_off, k1 - k0))
                members.extend([qi, b, -1, dl] for qi, b, dl in tile)

    own = np.zeros((total_q, 3), dtype=np.int32)
    covered = np.zeros(n_rows, dtype=np.int32)
    own_cols = np.split(C[own_mask], np.searchsorted(R[own_mask], np.arange(1, n_rows)))
    cols = []
    n_cols = 0
    for b in range(n_rows):
        n_b = int(lens[b])
        end = n_b + extend if width is None else max(n_b, min(n_b + extend, width))
        covered[b] = end
        mine = np.concatenate([own_cols[b], np.arange(n_b, end)])
        for qi in queries[b]:
            own[qi] = (b, n_cols, len(mine))
            cols.append(mine)
            n_cols += len(mine)

    members_a = np.asarray(members, dtype=np.int32).reshape(-1, MEMBER_FIELDS)
    parts = np.zeros((total_q, 2), dtype=np.int32)
    if len(members_a):  # each query's slots contiguous
        by_q = np.argsort(members_a[:, 0], kind="stable")
        members_a[by_q, 2] = np.arange(len(members_a), dtype=np.int32)
        cnt = np.bincount(members_a[:, 0], minlength=total_q)
        parts[:, 0] = np.cumsum(cnt) - cnt
        parts[:, 1] = cnt
    if not len(items):
        return None
    return GroupPlan(items=np.asarray(items, dtype=np.int32).reshape(-1, ITEM_FIELDS),
                     pages=np.asarray(pages, dtype=np.int32).reshape(-1, PAGE_FIELDS), members=members_a, own=own,
                     cols=np.concatenate(cols).astype(np.int32) if cols else np.zeros(0, dtype=np.int32),
                     parts=parts, shared_pages=shared_pages, covered=covered)
