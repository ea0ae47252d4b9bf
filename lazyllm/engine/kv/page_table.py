"""A request's page table and the one object that edits it.

A table lists ``TableEntry`` rows in logical order: a page, the logical position of its first
slot in the request, the rotation (delta) the attention kernel applies to its stored keys,
and how many of its slots are valid. Entries are frozen; a request's table lives in its
``Allocation``, made and laid out by the KV planner (``planner.py``), grown while decoding
by the scheduler through ``append_page`` and ``advance``, and only copied by everything else
(the model runner's metadata, the decode state on the device).
"""
from __future__ import annotations

from collections.abc import Iterable

from ...cache.store import ChunkStore, Entry
from ..request import TableEntry

_new_tuple = tuple.__new__


class Allocation:
    """One request's pages and its page table; the only object that edits the table.

    ``table`` lists the entries in logical order (a tuple: read it, never edit it). The
    request holds pins on the cached entries it reads (``hold``) and owns its private pages
    (its own tokens, re-rotated copies, decode pages); ``release`` gives all of it back.

    ``epoch`` changes whenever the table is rebuilt (planned, rewritten for recovery,
    released). Between two changes of it the table only grows at its end: ``append_page``
    adds an entry, ``advance`` adds a slot to the last one. A copy of the table elsewhere (the
    decode state on the device, the model runner's arrays) is kept up to date by copying
    those changes while ``epoch`` is the one it copied; ``version`` counts every edit.
    """

    def __init__(self, store: ChunkStore):
        self._store = store
        self._ps = store.pool.page_size
        self._table: list[TableEntry] = []
        self._private: list[int] = []  # pages this request alone owns (freed on release)
        self._pinned: list[Entry] = []  # cached entries it reads (unpinned on release)
        self.epoch = 0
        self.version = 0
        self.keys: tuple | None = None  # the planner's memo: (prefix key, chunk keys), see segment_keys

    # -- reading ------------------------------------------------------------------------
    @property
    def table(self) -> tuple[TableEntry, ...]:
        return tuple(self._table)

    def entries(self, start: int = 0) -> tuple[TableEntry, ...]:
        """The entries from column ``start`` on."""
        return tuple(self._table[start:])

    @property
    def width(self) -> int:
        """Columns of the table."""
        return len(self._table)

    @property
    def last(self) -> TableEntry:
        return self._table[-1]

    def tail(self) -> tuple[int, int, int, int, int]:
        """``(col, page, pos, delta, len)`` of the last entry: what a decode step changed."""
        t = self._table
        return (len(t) - 1, *t[-1])

    def owns(self, page: int) -> bool:
        return page in self._private

    @property
    def private_pages(self) -> tuple[int, ...]:
        return tuple(self._private)

    @property
    def pinned(self) -> tuple[Entry, ...]:
        return tuple(self._pinned)

    # -- planning (KVPlanner and its policies) -------------------------------------------------
    def hold(self, e: Entry) -> None:
        """Keep ``e`` (already pinned for this request by the store) until ``release``."""
        self._pinned.append(e)

    def take_private(self, n: int) -> list[int] | None:
        """``n`` pages owned by this request alone (evicting unpinned cache entries if
        needed); ``None``, and nothing taken, when the pool cannot give them."""
        pages = self._store.alloc_pages(n)
        if pages is not None:
            self._private.extend(pages)
        return pages

    def set_table(self, entries: Iterable[TableEntry]) -> None:
        """Replace the whole table (a new ``epoch``)."""
        self._table = list(entries)
        self.epoch += 1
        self.version += 1

    def extend_table(self, entries: Iterable[TableEntry]) -> None:
        """Append entries the planner laid out (the request's own tokens)."""
        self._table.extend(entries)
        self.version += 1

    def privatize(self, cols: list[int]) -> list[tuple[int, int, int]] | None:
        """Replace the entries at ``cols`` by private pages that will hold copies of them
        re-rotated to delta 0 (a new ``epoch``); the copies to make, ``(src page, dst page,
        delta)`` each, or ``None`` (nothing changed) when the pool cannot give the pages."""
        dst = self.take_private(len(cols))
        if dst is None:
            return None
        copies = []
        for c, d in zip(cols, dst):
            e = self._table[c]
            copies.append((e.page, d, e.delta))
            self._table[c] = TableEntry(d, e.pos, 0, e.length)
        if cols:
            self.epoch += 1
            self.version += 1
        return copies

    def publish(self, col: int, key: bytes, stored_pos: int) -> None:
        """Hand the full private page at ``col`` to the store as the cached entry ``key``
        (kept pinned by this request); the table does not change."""
        page = self._table[col].page
        self._private.remove(page)
        self._pinned.append(self._store.adopt(key, [page], self._ps, stored_pos, "page"))

    # -- decoding (the scheduler) ------------------------------------------------------------
    def append_page(self, pos: int) -> bool:
        """A new empty private page at the end of the table, its slot 0 at logical position
        ``pos``; False (nothing changed) when the pool cannot give one."""
        pages = self.take_private(1)
        if pages is None:
            return False
        self._table.append(TableEntry(pages[0], pos, 0, 0))
        self.version += 1
        return True

    def advance(self) -> bool:
        """Claim the next slot of the last page for a new token; False (nothing changed)
        when there is none: the page is full, or not this request's (``append_page`` first)."""
        page, pos, delta, n = self._table[-1]
        if n >= self._ps or page not in self._private:
            return False
        # once per decoded token: tuple.__new__ skips the named tuple's Python-level __new__
        self._table[-1] = _new_tuple(TableEntry, (page, pos, delta, n + 1))
        self.version += 1
        return True

    # -- the end -------------------------------------------------------------------------------
    def release(self) -> list[Entry]:
        """Unpin what the request reads, free its private pages and empty its table (a new
        ``epoch``); returns the entries dropped with their pages (reserved and never
        computed, nobody else waiting for them)."""
        dropped = [e for e in self._pinned if self._store.release(e)]
        self._pinned = []
        self._store.pool.free(self._private)
        self._private = []
        self.set_table([])
        return dropped
