"""Fused elementwise kernels of the transformer layer (Triton), for CUDA.

A decode step of an 8B model at batch 1 reads 16 GB of weights in about 3.6 ms; the many
small torch ops around the GEMMs (RMSNorm's cast/pow/mean/rsqrt/mul, RoPE's casts, cat and
multiply, the two K/V index copies, SiLU and the gate product) cost as much again as
separate kernels. Each kernel here replaces one such group with one launch and computes
exactly what the torch code it replaces computes (same float32 intermediates, same
rounding points, no fused multiply-add contraction; only the order of RMSNorm's sum
differs), so the engine gives the same tokens with or without them:

* ``rms_norm``      == ``llama.rms_norm``: ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``;
  with ``gemma``, ``llama._gemma_norm``: ``(x * rsqrt(mean(x^2) + eps) * (1 + w)).to(dtype)``;
* ``add_rms_norm``  == ``h = h + y`` (rounded to the dtype) followed by ``rms_norm(h)``; for
  Gemma's sandwich norms ``h = h + gemma_norm(y, y_weight)`` first;
* ``silu_mul``      == ``F.silu(g) * u`` on the fused ``[g | u]`` projection (``gelu_tanh``:
  ``F.gelu(g, approximate="tanh") * u``);
* ``rope_qkv_write`` == the per-head q/k RMSNorm where the model has one (Qwen3, Gemma 3),
  ``reference.apply_rope`` on q and k of the fused ``[q | k | v]`` projection, then
  ``reference.write_kv_ref`` of k and v into their page slots;
* ``gemv_parts``    == ``F.linear`` of one row, split over the reduction: float32 partial
  sums ``(splits, 1, out)`` that the kernel after it (each of the above takes them in place
  of its projection input) adds up in a fixed order and rounds to the dtype, as ``F.linear``
  rounds its output. One launch, no separate reduce, one weight read at full bandwidth: what
  decode at batch 1 spends most of its time on. Not bit-identical to cuBLAS (another
  summation order).

The torch twins are those functions; ``tests/kernels/test_kernels_triton.py`` compares each kernel
with its twin on random inputs in Triton's interpreter.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lazyllm.intmath import next_pow2

__all__ = ["rms_norm", "add_rms_norm", "silu_mul", "rope_qkv_write", "gemv_parts", "linear_or_parts"]


# whether this module's kernels run in Triton's interpreter: decided when it is imported
# (``TRITON_INTERPRET=1`` then), as in ``triton/_common.py``
_INTERPRETED = bool(triton.knobs.runtime.interpret)


def _interpreting() -> bool:
    return _INTERPRETED


@triton.jit
def _sum(x, axis: tl.constexpr):
    # tl.sum spelled with its combine function: also runs in the interpreter when triton
    # was imported before TRITON_INTERPRET was set (see lazyllm.kernels.triton._common._sum)
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _load_proj(P, off, mask, stride_s, SPLITS: tl.constexpr, DT: tl.constexpr):
    """A projection output at ``off`` as float32: loaded (``SPLITS == 0``), or the sum of its
    ``SPLITS`` float32 partials (``gemv_parts``), in split order, rounded to the dtype ``DT``
    as ``F.linear`` rounds its output."""
    if SPLITS == 0:
        return tl.load(P + off, mask=mask, other=0.0).to(tl.float32)
    acc = tl.load(P + off, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLITS):
        acc += tl.load(P + i * stride_s + off, mask=mask, other=0.0)
    return acc.to(DT).to(tl.float32)


@triton.jit
def _gemma_scale(xf, w, eps, N, DT: tl.constexpr):
    """``llama._gemma_norm`` of a float32 row: ``(x * rsqrt(mean(x^2) + eps) * (1 + w))`` in
    float32, rounded to ``DT`` once."""
    var = _sum(xf * xf, 0) / N
    return (xf * (1.0 / tl.sqrt(var + eps)) * (1.0 + w.to(tl.float32))).to(DT)


@triton.jit
def _rms_norm_kernel(X, Y, H, R, W, stride_x, stride_y, stride_h, stride_r, N, eps, stride_ys,
                     ADD: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr = 0,
                     GEMMA: tl.constexpr = False, WY=None, NORM_Y: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + row * stride_x + offs, mask=m, other=0.0)
    if ADD:  # h = h + y, rounded to the activations' dtype as torch does, and stored
        if NORM_Y:  # Gemma's sandwich: h = h + norm(y, WY), the norm rounded to the dtype first
            y = _load_proj(Y, row * stride_y + offs, m, stride_ys, SPLITS, H.dtype.element_ty)
            wy = tl.load(WY + offs, mask=m, other=0.0)
            x = x.to(tl.float32) + _gemma_scale(y, wy, eps, N, H.dtype.element_ty).to(tl.float32)
        else:
            x = x.to(tl.float32) + _load_proj(Y, row * stride_y + offs, m, stride_ys, SPLITS, H.dtype.element_ty)
        x = x.to(H.dtype.element_ty)
        tl.store(H + row * stride_h + offs, x, mask=m)
    xf = x.to(tl.float32)
    if GEMMA:
        w = tl.load(W + offs, mask=m, other=0.0)
        tl.store(R + row * stride_r + offs, _gemma_scale(xf, w, eps, N, R.dtype.element_ty), mask=m)
    else:
        var = _sum(xf * xf, 0) / N
        xn = (xf * (1.0 / tl.sqrt(var + eps))).to(R.dtype.element_ty)
        w = tl.load(W + offs, mask=m, other=0.0)
        tl.store(R + row * stride_r + offs, (w.to(tl.float32) * xn.to(tl.float32)).to(R.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``(n, hidden)``; same arithmetic as transformers'
    LlamaRMSNorm (normalise in float32, round, scale by ``weight`` in ``x.dtype``), or with
    ``gemma`` as Gemma3RMSNorm (``x * rsqrt(...) * (1 + w)`` in float32, rounded once:
    ``llama._gemma_norm``)."""
    n, hidden = x.shape
    out = torch.empty_like(x)
    if n:
        extra = dict(GEMMA=True) if gemma else {}
        _rms_norm_kernel[(n,)](x, x, x, out, weight, x.stride(0), 0, 0, out.stride(0), hidden, float(eps), 0,
                               ADD=False, BLOCK=next_pow2(hidden), num_warps=8 if hidden >= 2048 else 4,
                               enable_fp_fusion=False, **extra)
    return out


def add_rms_norm(h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, *, gemma: bool = False,
                 y_weight: torch.Tensor | None = None):
    """``h + y`` (the residual stream, rounded to its dtype) and its RMSNorm, in one pass.
    Returns ``(h + y, rms_norm(h + y))``; ``h`` is not modified. ``y`` ``(n, hidden)``, or
    its float32 partial sums ``(splits, n, hidden)`` from ``gemv_parts``.

    ``gemma``: Gemma norms (``rms_norm(..., gemma=True)``); ``y_weight`` (Gemma's sandwich
    norms, needs ``gemma``): ``y`` is normalised with it before the add, so the result is
    ``(h + norm(y, y_weight), norm(h + norm(y, y_weight), weight))``."""
    n, hidden = h.shape
    hs = torch.empty_like(h)
    out = torch.empty_like(h)
    splits, stride_ys = _parts(y)
    if y_weight is not None and not gemma:
        raise ValueError("y_weight (a norm of y before the add) is Gemma's sandwich norm: pass gemma=True")
    if n:
        extra = dict(GEMMA=True, WY=y_weight, NORM_Y=y_weight is not None) if gemma else {}
        _rms_norm_kernel[(n,)](h, y, hs, out, weight, h.stride(0), y.stride(-2), hs.stride(0), out.stride(0),
                               hidden, float(eps), stride_ys, ADD=True, BLOCK=next_pow2(hidden), SPLITS=splits,
                               num_warps=8 if hidden >= 2048 else 4, enable_fp_fusion=False, **extra)
    return hs, out


@triton.jit
def _gelu_tanh(g, LIBDEVICE: tl.constexpr):
    """``F.gelu(g, approximate="tanh")`` in float32, as torch's kernel spells it:
    ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))``. ``LIBDEVICE``: CUDA's ``tanhf``
    (what torch calls); otherwise (the interpreter, which has no libdevice)
    ``sign(z) (1 - e) / (1 + e)`` with ``e = exp(-2 |z|)``."""
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    if LIBDEVICE:
        t = tl.extra.cuda.libdevice.tanh(inner)
    else:
        e = tl.exp(-2.0 * tl.abs(inner))
        t = (1.0 - e) / (1.0 + e)
        t = tl.where(inner < 0, -t, t)
    return 0.5 * g * (1.0 + t)


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_o, N, stride_s, BLOCK: tl.constexpr, SPLITS: tl.constexpr = 0,
                     GELU: tl.constexpr = False, LIBDEVICE: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    g = _load_proj(GU, row * stride_gu + offs, m, stride_s, SPLITS, Out.dtype.element_ty)
    u = _load_proj(GU, row * stride_gu + N + offs, m, stride_s, SPLITS, Out.dtype.element_ty)
    if GELU:
        a = _gelu_tanh(g, LIBDEVICE).to(Out.dtype.element_ty)  # F.gelu(tanh), rounded to the dtype
    else:
        a = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty)  # F.silu, rounded to the dtype
    tl.store(Out + row * stride_o + offs, (a.to(tl.float32) * u).to(Out.dtype.element_ty), mask=m)


def silu_mul(gu: torch.Tensor, dtype: torch.dtype | None = None, *, gelu_tanh: bool = False) -> torch.Tensor:
    """``F.silu(g) * u`` for ``gu = [g | u]`` of shape ``(n, 2 * inter)``, or its float32
    partial sums ``(splits, n, 2 * inter)`` from ``gemv_parts`` (then ``dtype`` is the
    activations' dtype). ``gelu_tanh``: ``F.gelu(g, approximate="tanh") * u`` (Gemma)."""
    splits, stride_s = _parts(gu)
    n, two = gu.shape[-2:]
    inter = two // 2
    out = torch.empty((n, inter), dtype=dtype if splits else gu.dtype, device=gu.device)
    if n:
        block = 1024
        extra = dict(GELU=True, LIBDEVICE=not _interpreting()) if gelu_tanh else {}
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](gu, out, gu.stride(-2), out.stride(0), inter, stride_s,
                                                         BLOCK=block, SPLITS=splits, num_warps=4,
                                                         enable_fp_fusion=False, **extra)
    return out


@triton.jit
def _head_norm(x, rs, w, QK_NORM: tl.constexpr, DT: tl.constexpr):
    """One head's row ``x`` (float32) normalised by its ``rs = rsqrt(mean(x^2) + eps)``,
    as float32 holding a ``DT`` value: ``QK_NORM == 1`` ``llama.rms_norm`` (round, then
    scale by ``w`` in the dtype), ``2`` ``llama._gemma_norm`` (``x rs (1 + w)``, one rounding)."""
    if QK_NORM == 2:
        return (x * rs * (1.0 + w)).to(DT).to(tl.float32)
    else:
        return (w * (x * rs).to(DT).to(tl.float32)).to(DT).to(tl.float32)


@triton.jit
def _rope_qkv_write_kernel(QKV, Cos, Sin, Q, K, V, Slots, stride_t, stride_c, stride_qt, stride_qh,
                           stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_s,
                           NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                           PAGE_SIZE: tl.constexpr, HB: tl.constexpr, SPLITS: tl.constexpr = 0,
                           QN=None, KN=None, eps: tl.constexpr = 0.0, QK_NORM: tl.constexpr = 0):
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * HB + tl.arange(0, HB)  # HB heads of q, k and v of this token: rows of the tile
    offs = tl.arange(0, D)
    rot = offs < 2 * HALF
    lo = offs < HALF
    partner = tl.where(lo, offs + HALF, offs - HALF)
    cidx = tl.where(rot, offs, 0)
    c = tl.load(Cos + t * stride_c + cidx, mask=rot, other=1.0)
    s = tl.load(Sin + t * stride_c + cidx, mask=rot, other=0.0)
    hm = hh < NQ + 2 * NKV
    base = t * stride_t + hh[:, None] * D
    x = _load_proj(QKV, base + offs[None, :], hm[:, None], stride_s, SPLITS, Q.dtype.element_ty)
    xp = _load_proj(QKV, base + partner[None, :], hm[:, None] & rot[None, :], stride_s, SPLITS, Q.dtype.element_ty)
    if QK_NORM:  # per-head RMSNorm of q and k (Qwen3, Gemma 3) before the rotation; v as it is
        is_k = (hh >= NQ)[:, None]
        normed = (hh < NQ + NKV)[:, None]
        rs = 1.0 / tl.sqrt(_sum(x * x, 1) / D + eps)
        w = tl.where(is_k, tl.load(KN + offs).to(tl.float32)[None, :], tl.load(QN + offs).to(tl.float32)[None, :])
        wp = tl.where(is_k, tl.load(KN + partner).to(tl.float32)[None, :],
                      tl.load(QN + partner).to(tl.float32)[None, :])
        x = tl.where(normed, _head_norm(x, rs[:, None], w, QK_NORM, Q.dtype.element_ty), x)
        xp = tl.where(normed & rot[None, :], _head_norm(xp, rs[:, None], wp, QK_NORM, Q.dtype.element_ty), xp)
    xp = tl.where(lo[None, :], -xp, xp)  # rotate_half: [-x2, x1]
    is_v = hh >= NQ + NKV
    r = x * c[None, :] + xp * s[None, :]
    y = tl.where(is_v[:, None], x, r)
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
                   v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int, *,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                   gemma: bool = False) -> torch.Tensor:
    """RoPE on q and k of the fused projection and K/V written to their slots.

    With ``q_norm``/``k_norm`` (``(head_dim,)`` weights: Qwen3, Gemma 3) each head's q and k
    row is RMS-normalised first, as ``llama.rms_norm`` (``gemma``: ``llama._gemma_norm``)
    computes it, then rotated.

    Parameters
    ----------
    qkv : ``(n, (num_heads + 2 * num_kv_heads) * head_dim)``, rows contiguous; or its float32
        partial sums ``(splits, n, ...)`` from ``gemv_parts`` (q then comes in the cache's dtype).
    cos, sin : ``(n, rotary_dim)`` float32 (``reference.rope_cos_sin`` of the positions).
    k_cache, v_cache : one layer's pages ``(num_pages, page_size, num_kv_heads, head_dim)``.
    slots : ``(n,)`` int, ``page * page_size + slot`` of each token.

    Returns
    -------
    q ``(n, num_heads, head_dim)`` rotated, in ``qkv.dtype``.
    """
    splits, stride_s = _parts(qkv)
    n = qkv.shape[-2]
    d = k_cache.shape[-1]
    q = torch.empty((n, num_heads, d), dtype=k_cache.dtype if splits else qkv.dtype, device=qkv.device)
    if n:
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        cos = cos.contiguous()
        sin = sin.contiguous()
        heads = num_heads + 2 * num_kv_heads
        hb = min(8, next_pow2(heads))  # several programs per token: a decode token's heads in parallel
        extra = {}
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm go together")
        if q_norm is not None:
            if q_norm.shape != (d,) or k_norm.shape != (d,):
                raise ValueError(f"q/k norm weights must have shape ({d},)")
            extra = dict(QN=q_norm.contiguous(), KN=k_norm.contiguous(), eps=float(eps), QK_NORM=2 if gemma else 1)
        _rope_qkv_write_kernel[(n, triton.cdiv(heads, hb))](
            qkv, cos, sin, q, k_cache, v_cache, slots, qkv.stride(-2), cos.stride(0), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), stride_s,
            NQ=num_heads, NKV=num_kv_heads, D=d, HALF=cos.shape[-1] // 2, PAGE_SIZE=k_cache.shape[1],
            HB=hb, SPLITS=splits, num_warps=4 if hb * d >= 1024 else 1, enable_fp_fusion=False, **extra)
    return q


def _parts(y: torch.Tensor) -> tuple[int, int]:
    """``(splits, stride between splits)`` of a projection input: ``(0, 0)`` for a plain
    ``(n, N)`` tensor, else for float32 partial sums ``(splits, n, N)`` from ``gemv_parts``."""
    if y.dim() == 3:
        if y.dtype != torch.float32:
            raise ValueError(f"partial sums must be float32, got {y.dtype}")
        return y.shape[0], y.stride(0)
    return 0, 0


@triton.jit
def _gemv_parts_kernel(X, W, P, N, stride_w, stride_p,
                       K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid ``(cdiv(N, BLOCK_N), cdiv(K, BLOCK_K))``: ``P[ks, n] = sum_{k in split ks}
    W[n, k] X[k]`` in float32. Each program loads its whole ``BLOCK_N x BLOCK_K`` tile of
    the weight at once (no loop), so every byte of the weight is in flight together."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1)
    rk = ks * BLOCK_K + tl.arange(0, BLOCK_K)
    nm = rn < N
    km = rk < K
    w = tl.load(W + rn.to(tl.int64)[:, None] * stride_w + rk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
    x = tl.load(X + rk, mask=km, other=0.0).to(tl.float32)
    part = _sum(w.to(tl.float32) * x[None, :], 1)
    tl.store(P + ks * stride_p + rn, part, mask=nm)


# (BLOCK_N, BLOCK_K, num_warps) by weight shape ``(N, K)``, or None: that shape stays with
# the GEMM library; the default where a shape is not listed (measured on H200, the
# projections of one batch-1 step).
# The down projection of an 8B model (4096 x 14336) stays with cuBLAS: split 14 ways, its
# partial sums cost the single-program add + RMSNorm after it as much as the GEMV saves.
GEMV_CONFIGS: dict = {(4096, 14336): None}
GEMV_DEFAULT = (32, 1024, 8)


def gemv_parts(x: torch.Tensor, weight: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``F.linear(x, weight)`` for one row ``x`` ``(1, K)``, as float32 partial sums
    ``(cdiv(K, BLOCK_K), 1, N)`` over splits of the reduction: their sum, in split order,
    rounded to ``x.dtype``, is the projection. The kernels above take them in place of
    their projection input, so the split-K reduction costs no launch of its own.
    ``config``: ``(BLOCK_N, BLOCK_K, num_warps)``, default ``GEMV_DEFAULT``."""
    n, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"gemv_parts needs x (1, {k}) and a row-major weight; got {tuple(x.shape)}")
    bn, bk, warps = config or GEMV_DEFAULT
    splits = triton.cdiv(k, bk)
    parts = torch.empty((splits, 1, n), device=x.device, dtype=torch.float32)
    _gemv_parts_kernel[(triton.cdiv(n, bn), splits)](x, weight, parts, n, weight.stride(0), parts.stride(0),
                                                      K=k, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return parts


def linear_or_parts(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    linear) -> torch.Tensor:
    """The projection as the kernels above take it: ``gemv_parts`` (configured by
    ``GEMV_CONFIGS``) for one row of half precision without bias, else
    ``linear(x, weight, bias)``."""
    if x.shape[0] == 1 and bias is None and x.dtype in (torch.float16, torch.bfloat16):
        cfg = GEMV_CONFIGS.get(tuple(weight.shape), GEMV_DEFAULT)
        if cfg is not None:
            return gemv_parts(x, weight, cfg)
    return linear(x, weight, bias)
