"""Copy kernels: the Block-Attention baseline's re-rotating page copy, and the KV write."""
from __future__ import annotations

import torch

import triton
import triton.language as tl
from lazyllm.intmath import next_pow2

from .rope import _cos_sin

__all__ = ["rerotate_copy_triton", "write_kv_triton"]


@triton.jit
def _rerotate_copy(
    K, V, Src, Dst, Cos, Sin,
    stride_kl, stride_kp, stride_ks, stride_kh,
    stride_vl, stride_vp, stride_vs, stride_vh,
    n_pages,
    ROWS: tl.constexpr, NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    PASS: tl.constexpr, PASS_P: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Grid ``(n_pages * row_blocks, num_layers)``: one block of one page of one layer."""
    n_rb: tl.constexpr = (ROWS + BLOCK_R - 1) // BLOCK_R
    pid = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    i = pid // n_rb
    rb = pid % n_rb
    src = tl.load(Src + i).to(tl.int64)
    dst = tl.load(Dst + i).to(tl.int64)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)  # row = slot * NUM_HEADS + head
    rm = r < ROWS
    slot = r // NUM_HEADS
    head = r % NUM_HEADS
    k_off = slot * stride_ks + head * stride_kh
    v_off = slot * stride_vs + head * stride_vh
    ks = K + layer * stride_kl + src * stride_kp + k_off
    kd = K + layer * stride_kl + dst * stride_kp + k_off
    vs = V + layer * stride_vl + src * stride_vp + v_off
    vd = V + layer * stride_vl + dst * stride_vp + v_off
    offs_d = tl.arange(0, HEAD_DIM)
    v = tl.load(vs[:, None] + offs_d[None, :], mask=rm[:, None])
    if HALF > 0:
        offs_h = tl.arange(0, HALF_P)
        hm = offs_h < HALF
        c = tl.load(Cos + i * HALF + offs_h, mask=hm, other=1.0)[None, :]
        s = tl.load(Sin + i * HALF + offs_h, mask=hm, other=0.0)[None, :]
        m2 = rm[:, None] & hm[None, :]
        k1 = tl.load(ks[:, None] + offs_h[None, :], mask=m2).to(tl.float32)
        k2 = tl.load(ks[:, None] + HALF + offs_h[None, :], mask=m2).to(tl.float32)
        if PASS > 0:
            offs_p = tl.arange(0, PASS_P)
            mp = rm[:, None] & (offs_p[None, :] < PASS)
            kp = tl.load(ks[:, None] + 2 * HALF + offs_p[None, :], mask=mp)
            tl.store(kd[:, None] + 2 * HALF + offs_p[None, :], kp, mask=mp)
        tl.store(kd[:, None] + offs_h[None, :], (k1 * c - k2 * s).to(K.dtype.element_ty), mask=m2)
        tl.store(kd[:, None] + HALF + offs_h[None, :], (k2 * c + k1 * s).to(K.dtype.element_ty), mask=m2)
    else:
        k = tl.load(ks[:, None] + offs_d[None, :], mask=rm[:, None])
        tl.store(kd[:, None] + offs_d[None, :], k, mask=rm[:, None])
    tl.store(vd[:, None] + offs_d[None, :], v, mask=rm[:, None])


def rerotate_copy_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Block-Attention baseline: copy pages ``src -> dst`` rotating keys by ``delta``.

    Same function as ``reference.rerotate_copy_ref``, one pass over the bytes.

    Parameters
    ----------
    k_cache, v_cache : ``(num_layers, num_pages, page_size, num_kv_heads, head_dim)``,
        last dim contiguous; written in place at ``dst_pages`` for every layer.
    src_pages, dst_pages : ``(n,)`` int page ids; no ``dst`` page may be another pair's
        ``src`` (each program reads its source and writes its destination).
    delta : ``(n,)`` int rotation in positions for each copied page.
    inv_freq : ``(rotary_dim // 2,)`` float32.
    """
    n_layers, _, page_size, hkv, d = k_cache.shape
    n = src_pages.numel()
    if n == 0 or n_layers == 0:
        return
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous last dim")
    half = int(inv_freq.numel())
    pass_dim = d - 2 * half
    cos, sin = _cos_sin(delta.reshape(-1), inv_freq.to(k_cache.device))
    rows = page_size * hkv
    if block_rows is None:
        block_rows = min(next_pow2(rows), max(16, 8192 // d))
    if num_warps is None:
        num_warps = 4
    n_rb = triton.cdiv(rows, block_rows)
    grid = (n * n_rb, n_layers)
    _rerotate_copy[grid](
        k_cache, v_cache, src_pages, dst_pages, cos, sin,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        n,
        ROWS=rows, NUM_HEADS=hkv, HEAD_DIM=d, HALF=half,
        HALF_P=max(1, next_pow2(half)) if half else 1,
        PASS=pass_dim, PASS_P=max(1, next_pow2(pass_dim)) if pass_dim else 1,
        BLOCK_R=block_rows, num_warps=num_warps,
    )


@triton.jit
def _write_kv(
    Kc, Vc, Slots, Kn, Vn,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    if slot >= 0:
        page = slot // PAGE_SIZE
        s = slot % PAGE_SIZE
        h = tl.arange(0, HEADS_P)
        d = tl.arange(0, HEAD_DIM)
        m = (h < NUM_HEADS)[:, None]
        k = tl.load(Kn + t * stride_knt + h[:, None] * stride_knh + d[None, :], mask=m)
        v = tl.load(Vn + t * stride_vnt + h[:, None] * stride_vnh + d[None, :], mask=m)
        tl.store(Kc + page * stride_kp + s * stride_ks + h[:, None] * stride_kh + d[None, :],
                 k.to(Kc.dtype.element_ty), mask=m)
        tl.store(Vc + page * stride_vp + s * stride_vs + h[:, None] * stride_vh + d[None, :],
                 v.to(Vc.dtype.element_ty), mask=m)


def write_kv_triton(k_cache, v_cache, slot_mapping, k, v) -> None:
    """Scatter new keys/values ``(n, num_kv_heads, head_dim)`` into one layer's pages
    ``(num_pages, page_size, num_kv_heads, head_dim)`` at flat slots ``slot_mapping``
    ``(n,)`` (``page * page_size + slot``). Same as ``reference.write_kv_ref``; a
    negative slot is skipped (padding)."""
    n = slot_mapping.numel()
    if n == 0:
        return
    _, page_size, hkv, d = k_cache.shape
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _write_kv[(n,)](
        k_cache, v_cache, slot_mapping, k, v,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        PAGE_SIZE=page_size, NUM_HEADS=hkv, HEADS_P=next_pow2(hkv), HEAD_DIM=d,
        num_warps=4,
    )
