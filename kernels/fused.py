"""Fused elementwise kernels of the transformer layer (Triton), for CUDA.

A decode step of an 8B model at batch 1 reads 16 GB of weights in about 3.6 ms; the many
small torch ops around the GEMMs (RMSNorm's cast/pow/mean/rsqrt/mul, RoPE's casts, cat and
multiply, the two K/V index copies, SiLU and the gate product) cost as much again as
separate kernels. Each kernel here replaces one such group with one launch and computes
exactly what the torch code it replaces computes (same float32 intermediates, same
rounding points, no fused multiply-add contraction; only the order of RMSNorm's sum
differs), so the engine gives the same tokens with or without them:

* ``rms_norm``      == ``llama._rms_norm``: ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``;
* ``add_rms_norm``  == ``h = h + y`` (rounded to the dtype) followed by ``rms_norm(h)``;
* ``silu_mul``      == ``F.silu(g) * u`` on the fused ``[g | u]`` projection;
* ``rope_qkv_write`` == ``reference.apply_rope`` on q and k of the fused ``[q | k | v]``
  projection, then ``reference.write_kv_ref`` of k and v into their page slots;
* ``linear_one_row`` == ``F.linear`` for a single row (decode at batch 1, a matrix-vector
  product): on CUDA a Triton GEMV where it measures faster than cuBLAS for the shape (the
  choice is timed once per weight shape), else ``F.linear``. Not bit-identical to
  ``F.linear`` (another summation order), so it is off under ``batch_invariant``.

The torch twins are those functions; ``tests/test_kernels_triton.py`` compares each kernel
with its twin on random inputs in Triton's interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "add_rms_norm", "silu_mul", "rope_qkv_write", "linear_one_row"]


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@triton.jit
def _sum(x, axis: tl.constexpr):
    # tl.sum spelled with its combine function: also runs in the interpreter when triton
    # was imported before TRITON_INTERPRET was set (see triton_attention._sum)
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _rms_norm_kernel(X, Y, H, R, W, stride_x, stride_y, stride_h, stride_r, N, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0)
    if ADD:  # h = h + y, rounded to the activations' dtype as torch does, and stored
        x = (x.to(tl.float32) + tl.load(Y + row * stride_y + offs, mask=m, other=0.0).to(tl.float32))
        x = x.to(H.dtype.element_ty)
        tl.store(H + row * stride_h + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = _sum(xf * xf, 0) / N
    xn = (xf * (1.0 / tl.sqrt(var + eps))).to(R.dtype.element_ty)
    w = tl.load(W + offs, mask=m, other=0.0)
    tl.store(R + row * stride_r + offs, (w.to(tl.float32) * xn.to(tl.float32)).to(R.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``(n, hidden)``; same arithmetic as transformers'
    LlamaRMSNorm (normalise in float32, round, scale by ``weight`` in ``x.dtype``)."""
    n, hidden = x.shape
    out = torch.empty_like(x)
    if n:
        _rms_norm_kernel[(n,)](x, x, x, out, weight, x.stride(0), 0, 0, out.stride(0), hidden, float(eps),
                               ADD=False, BLOCK=_p2(hidden), num_warps=8 if hidden >= 2048 else 4,
                               enable_fp_fusion=False)
    return out


def add_rms_norm(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float):
    """``h + y`` (the residual stream, rounded to its dtype) and its RMSNorm, in one pass.
    Returns ``(h + y, rms_norm(h + y))``; ``h`` is not modified."""
    n, hidden = h.shape
    hs = torch.empty_like(h)
    out = torch.empty_like(h)
    if n:
        _rms_norm_kernel[(n,)](h, y, hs, out, weight, h.stride(0), y.stride(0), hs.stride(0), out.stride(0),
                               hidden, float(eps), ADD=True, BLOCK=_p2(hidden),
                               num_warps=8 if hidden >= 2048 else 4, enable_fp_fusion=False)
    return hs, out


@triton.jit
def _silu_mul_kernel(GU, O, stride_gu, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = tl.load(GU + row * stride_gu + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + N + offs, mask=m, other=0.0)
    a = (g / (1.0 + tl.exp(-g))).to(O.dtype.element_ty)  # F.silu, rounded to the dtype
    tl.store(O + row * stride_o + offs, (a.to(tl.float32) * u.to(tl.float32)).to(O.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``F.silu(g) * u`` for ``gu = [g | u]`` of shape ``(n, 2 * inter)``."""
    n, two = gu.shape
    inter = two // 2
    out = torch.empty((n, inter), dtype=gu.dtype, device=gu.device)
    if n:
        block = 1024
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](gu, out, gu.stride(0), out.stride(0), inter,
                                                         BLOCK=block, num_warps=4, enable_fp_fusion=False)
    return out


@triton.jit
def _rope_qkv_write_kernel(QKV, Cos, Sin, Q, K, V, Slots, stride_t, stride_c, stride_qt, stride_qh,
                           stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                           NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                           PAGE_SIZE: tl.constexpr, HP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hh = tl.arange(0, HP)  # every head of q, k and v of this token: rows of the tile
    offs = tl.arange(0, D)
    rot = offs < 2 * HALF
    lo = offs < HALF
    partner = tl.where(lo, offs + HALF, offs - HALF)
    cidx = tl.where(rot, offs, 0)
    c = tl.load(Cos + t * stride_c + cidx, mask=rot, other=1.0)
    s = tl.load(Sin + t * stride_c + cidx, mask=rot, other=0.0)
    hm = hh < NQ + 2 * NKV
    base = QKV + t * stride_t + hh[:, None] * D
    x = tl.load(base + offs[None, :], mask=hm[:, None], other=0.0)
    xp = tl.load(base + partner[None, :], mask=hm[:, None] & rot[None, :], other=0.0).to(tl.float32)
    xp = tl.where(lo[None, :], -xp, xp)  # rotate_half: [-x2, x1]
    is_v = hh >= NQ + NKV
    r = x.to(tl.float32) * c[None, :] + xp * s[None, :]
    y = tl.where(is_v[:, None], x.to(tl.float32), r)
    slot = tl.load(Slots + t)
    page = slot // PAGE_SIZE
    sl = slot % PAGE_SIZE
    qm = hh < NQ
    tl.store(Q + t * stride_qt + hh[:, None] * stride_qh + offs[None, :], y.to(Q.dtype.element_ty),
             mask=qm[:, None])
    km = (hh >= NQ) & (hh < NQ + NKV)
    kh = tl.where(km, hh - NQ, 0)
    tl.store(K + page * stride_kp + sl * stride_ks + kh[:, None] * stride_kh + offs[None, :],
             y.to(K.dtype.element_ty), mask=km[:, None])
    vh = tl.where(is_v & hm, hh - NQ - NKV, 0)
    tl.store(V + page * stride_vp + sl * stride_vs + vh[:, None] * stride_vh + offs[None, :],
             y.to(V.dtype.element_ty), mask=(is_v & hm)[:, None])


def rope_qkv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """RoPE on q and k of the fused projection and K/V written to their slots.

    Parameters
    ----------
    qkv : ``(n, (num_heads + 2 * num_kv_heads) * head_dim)``, rows contiguous.
    cos, sin : ``(n, rotary_dim)`` float32 (``reference.rope_cos_sin`` of the positions).
    k_cache, v_cache : one layer's pages ``(num_pages, page_size, num_kv_heads, head_dim)``.
    slots : ``(n,)`` int, ``page * page_size + slot`` of each token.

    Returns
    -------
    q ``(n, num_heads, head_dim)`` rotated, in ``qkv.dtype``.
    """
    n = qkv.shape[0]
    d = k_cache.shape[-1]
    q = torch.empty((n, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if n:
        if qkv.stride(1) != 1:
            qkv = qkv.contiguous()
        cos = cos.contiguous()
        sin = sin.contiguous()
        _rope_qkv_write_kernel[(n,)](
            qkv, cos, sin, q, k_cache, v_cache, slots, qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NQ=num_heads, NKV=num_kv_heads, D=d, HALF=cos.shape[-1] // 2, PAGE_SIZE=k_cache.shape[1],
            HP=_p2(num_heads + 2 * num_kv_heads), num_warps=4, enable_fp_fusion=False)
    return q


@triton.jit
def _gemv_kernel(X, W, Bias, Y, N, stride_w, K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``Y[n] = sum_k W[n, k] X[k] (+ Bias[n])``, float32 accumulation; grid ``(cdiv(N, BLOCK_N),)``.
    ``K`` (a model width) is a compile-time constant: a static loop."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = rn < N
    rk0 = tl.arange(0, BLOCK_K)
    acc = tl.full([BLOCK_N, BLOCK_K], 0.0, dtype=tl.float32)
    w_row = W + rn.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + rk0
        km = rk < K
        x = tl.load(X + rk, mask=km, other=0.0).to(tl.float32)
        w = tl.load(w_row + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = _sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(Bias + rn, mask=nm, other=0.0).to(tl.float32)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=nm)


# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried per weight shape on the first call
_GEMV_CONFIGS = [(8, 512, 4, 3), (16, 512, 4, 3), (16, 256, 4, 4), (32, 256, 8, 3), (8, 1024, 4, 2), (4, 1024, 4, 3)]
_GEMV_CHOICE: dict = {}  # (N, K, dtype, device) -> config, or None for F.linear


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: tuple[int, int, int, int] = (16, 512, 4, 3), out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of one row ``x`` ``(1, K)`` (or ``(K,)``) by ``weight`` ``(N, K)`` with the
    Triton GEMV; returns ``(1, N)`` in ``x.dtype``."""
    xr = x.reshape(-1)
    n, k = weight.shape
    if xr.numel() != k or weight.stride(1) != 1:
        raise ValueError(f"gemv needs one row of {k} and a row-major weight, got {tuple(x.shape)}")
    xr = xr.contiguous()
    y = out if out is not None else torch.empty((1, n), device=x.device, dtype=x.dtype)
    bn, bk, warps, stages = config
    _gemv_kernel[(triton.cdiv(n, bn),)](xr, weight, bias if bias is not None else xr, y, n, weight.stride(0), K=k,
                                        HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk,
                                        num_warps=warps, num_stages=stages)
    return y


def _time(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _choose(x: torch.Tensor, weight: torch.Tensor, bias):
    """The fastest of the GEMV configurations and ``F.linear`` for this weight shape (None:
    ``F.linear``), timed once, outside any CUDA graph capture."""
    key = (tuple(weight.shape), weight.dtype, x.device)
    if key not in _GEMV_CHOICE:
        best, best_ms = None, _time(lambda: torch.nn.functional.linear(x, weight, bias))
        for cfg in _GEMV_CONFIGS:
            try:
                ms = _time(lambda: gemv(x, weight, bias, cfg))
            except Exception:  # noqa: BLE001  a configuration that does not compile here
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        _GEMV_CHOICE[key] = best
    return _GEMV_CHOICE[key]


def linear_one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for inputs of one row: the Triton GEMV where it was measured faster for
    this weight shape on this device, else ``F.linear`` (also for other inputs and off CUDA)."""
    if x.shape[0] != 1 or x.device.type != "cuda" or weight.stride(1) != 1:
        return torch.nn.functional.linear(x, weight, bias)
    key = (tuple(weight.shape), weight.dtype, x.device)
    if key not in _GEMV_CHOICE:
        if torch.cuda.is_current_stream_capturing():
            return torch.nn.functional.linear(x, weight, bias)  # untimed shape inside a capture
        _choose(x, weight, bias)
    cfg = _GEMV_CHOICE[key]
    return torch.nn.functional.linear(x, weight, bias) if cfg is None else gemv(x, weight, bias, cfg)
