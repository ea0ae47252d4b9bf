"""The reuse modes (``LazyLLM(reuse=...)``) and every question asked about one, answered in
one place. A leaf module: the configuration validates with it (it imports no layer), the
KV planner's policies (``lazyllm.engine.kv.planner``) carry their mode and answer from it,
and the input processor, the warm-up and the engine ask the policy or the configuration's
mode (``EngineConfig.mode``) instead of testing the mode's name.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReuseMode:
    """One reuse mode.

    caches_chunks : chunks (and the system prefix) are cached as entries, found again at any
        position: ``warm()`` does something, a disk tier, packets and ``escalate_below`` apply,
        and the input processor hashes chunk keys ahead of the engine.
    makes_copies : each request gets private re-rotated copies of its shifted chunk pages
        (the Block-Attention baseline) instead of reading them in place.
    home_exact : with ``chunk_context="prefix"``, a chunk read where it was encoded (every
        entry at delta 0) already holds full attention's KV, so recovery recomputes nothing of
        it (``exact_at_home``). Off for the Block-Attention baseline, measured as published.
    """

    name: str
    caches_chunks: bool
    makes_copies: bool = False
    home_exact: bool = False

    @property
    def shares_chunk_pages(self) -> bool:
        """Requests of one batch read the same chunk pages (no private copies, no private
        prompt): the decode batches the warm-up sizes hold only their own pages beside them."""
        return self.caches_chunks and not self.makes_copies

    def exact_at_home(self, chunk_context: str) -> bool:
        """Whether a chunk at its home position holds full attention's KV (``home_exact``)."""
        return self.home_exact and chunk_context == "prefix"


MODES: dict[str, ReuseMode] = {m.name: m for m in (
    # chunk pages referenced where they lie, positions applied in the attention kernel
    ReuseMode("lazy", caches_chunks=True, home_exact=True),
    # the Block-Attention baseline: a private re-rotated copy of every shifted chunk page
    ReuseMode("block", caches_chunks=True, makes_copies=True),
    # full attention reusing identical-prefix pages (as vLLM)
    ReuseMode("prefix", caches_chunks=False),
    # full attention, nothing reused
    ReuseMode("none", caches_chunks=False),
)}
REUSE_MODES = tuple(MODES)
CHUNK_CACHING_MODES = tuple(name for name, m in MODES.items() if m.caches_chunks)

__all__ = ["ReuseMode", "MODES", "REUSE_MODES", "CHUNK_CACHING_MODES"]
