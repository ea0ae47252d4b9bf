"""Batch-invariant projections: ``linear_rows``, the GEMM of ``LazyLLM(batch_invariant=True)``."""
from __future__ import annotations

import torch

from ..intmath import cdiv

BATCH_INVARIANT_ROWS = 128


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                rows: int = BATCH_INVARIANT_ROWS) -> torch.Tensor:
    """``F.linear`` computed in blocks of exactly ``rows`` rows (the last one zero-padded).

    A GEMM library picks its kernel, tiling and split of the reduction by the shape of the
    call, so one token's output can differ in the last bits depending on how many other
    tokens share the call. Here every GEMM has the same shape, ``(rows, in) x (in, out)``,
    so a row's result depends on that row alone: batch-invariant, and the same in prefill
    and decode. Costs one weight read per block (small next to the padding-free call for
    decode batches, more for long prefills).

    ``x`` ``(n, in)``, ``weight`` ``(out, in)``; returns ``(n, out)`` in ``x.dtype``.
    """
    n, k = x.shape
    nb = cdiv(n, rows)
    if n != nb * rows:
        xp = x.new_zeros((nb * rows, k))
        xp[:n] = x
    else:
        xp = x.contiguous()
    out = x.new_empty((nb * rows, weight.shape[0]))
    wt = weight.t()
    for i in range(nb):
        blk = slice(i * rows, (i + 1) * rows)
        if bias is None:
            torch.mm(xp[blk], wt, out=out[blk])
        else:
            torch.addmm(bias, xp[blk], wt, out=out[blk])
    return out[:n]


__all__ = ["BATCH_INVARIANT_ROWS", "linear_rows"]
