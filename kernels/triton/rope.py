"""Host-side RoPE tables of the kernels: per-entry cos/sin of the page deltas, and the runs
of equal deltas that the query-rotating loops walk. Torch only (no kernel), device ops only
(no host sync), so an engine can build them once per step inside a CUDA graph."""
from __future__ import annotations

import torch

__all__ = ["delta_runs", "rope_table"]


def delta_runs(block_delta: torch.Tensor) -> torch.Tensor:
    """For each table entry, the index of the next entry whose delta differs.

    Parameters
    ----------
    block_delta : ``(batch, max_blocks)`` int.

    Returns
    -------
    ``(batch, max_blocks)`` int32, contiguous: ``runs[b, e]`` is the smallest ``e' > e``
    with ``block_delta[b, e'] != block_delta[b, e]`` (``max_blocks`` if none). The query-
    rotating kernel walks a row's entries run by run with it. Device ops only (no host
    sync), so it can be built inside a CUDA graph.
    """
    bsz, n = block_delta.shape
    idx = torch.arange(n, device=block_delta.device, dtype=torch.int32).expand(bsz, n)
    starts = torch.ones((bsz, n), dtype=torch.bool, device=block_delta.device)
    starts[:, 1:] = block_delta[:, 1:] != block_delta[:, :-1]
    cand = torch.where(starts, idx, torch.full_like(idx, n))  # a run starts at e'
    nxt = torch.full_like(idx, n)
    if n > 1:
        # smallest run start strictly after e: a reverse running minimum of cand[e + 1:]
        nxt[:, :-1] = cand[:, 1:].flip(-1).cummin(-1).values.flip(-1)
    return nxt.contiguous()


def _cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor):
    ang = delta.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    return ang.cos().contiguous(), ang.sin().contiguous()


def rope_table(block_delta: torch.Tensor, inv_freq: torch.Tensor):
    """cos and sin of every table entry's delta rotation, and the runs of equal deltas.

    Parameters
    ----------
    block_delta : ``(batch, max_blocks)`` int, rotation of each entry in positions.
    inv_freq : ``(rotary_dim // 2,)`` float32.

    Returns
    -------
    cos, sin : ``(batch, max_blocks, rotary_dim // 2)`` float32, contiguous; the same
    arithmetic as ``reference.rope_cos_sin``.
    runs : ``delta_runs(block_delta)``.
    The table depends only on the step's metadata, so an engine can build it once per step
    and pass it to every layer's ``paged_attention_triton(..., rope=...)``.
    """
    return (*_cos_sin(block_delta, inv_freq), delta_runs(block_delta))

