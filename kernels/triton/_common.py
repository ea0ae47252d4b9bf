"""Shared pieces of the Triton kernels: the interpreter shim and small ``@triton.jit`` helpers.

Every kernel module of this package and the Gluon prefill import their helpers from here,
so both round the query rotation alike. Whether the kernels run in Triton's interpreter is
decided when this module is imported (``TRITON_INTERPRET=1`` then); see
``lazyllm.kernels.loader.triton_kernels`` for how the interpreted copy is loaded.
"""
from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
# Finite start of the running max: a row that has seen only masked keys keeps
# exp2(-inf - _M_INIT) == 0 instead of exp2(-inf + inf) == nan.
_M_INIT = tl.constexpr(-1.0e30)


def _interpreting() -> bool:
    """Whether this module's kernels run in Triton's interpreter: decided when it was
    imported (``TRITON_INTERPRET=1`` then), whatever the environment says later."""
    return _INTERPRETED


_INTERPRETED = bool(triton.knobs.runtime.interpret)


def _fix_interpreter_scalars() -> None:
    """Triton 3.6's interpreter turns a scalar into a loop bound with ``int(a)`` on a
    numpy array of shape ``(1,)``, which numpy >= 2.4 refuses, so any ``range`` over a
    run-time value fails there. Take the element instead. Interpreter only; idempotent."""
    try:
        from triton.runtime import interpreter as _ti

        orig = _ti._patch_lang_tensor
    except (ImportError, AttributeError):
        return
    if getattr(orig, "_lazyllm_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._lazyllm_fixed = True
    _ti._patch_lang_tensor = patched


if _interpreting():
    _fix_interpreter_scalars()


# Reductions spelled through tl.reduce with the standard combine functions: the same code
# as tl.max/min/sum when compiled, and in the interpreter they work even when triton was
# imported before TRITON_INTERPRET was set (the standard library's own jit wrappers then
# refuse to run there; these combine functions hit the interpreter's numpy fast path).
@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)




@triton.jit
def _fma2(a, b, c):
    """``a * b + c`` on pairs of 16-bit values (``fma.rn.{bf16,f16}x2``: one instruction
    per two elements; compiled kernels only, Triton's interpreter runs no inline PTX)."""
    if a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _mul2(a, b):
    """``a * b`` on pairs of 16-bit values (``mul.rn.{bf16,f16}x2``; see ``_fma2``)."""
    if a.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("mul.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _cos_sin_of(ang, APPROX: tl.constexpr):
    """cos and sin of float32 angles (``delta * inv_freq``, up to ~1e5 rad), without a table.

    The angle is reduced into [-pi, pi] with a two-constant Cody-Waite step (``k * 6.28125``
    is exact for ``|k| < 2**15``; the low part carries the rest of 2 pi), then ``APPROX``:
    the SFU's ``cos.approx.f32`` / ``sin.approx.f32`` (compiled kernels; absolute error about
    2**-21, far below the 16-bit rounding that follows), else ``tl.cos`` / ``tl.sin``."""
    k = tl.extra.cuda.libdevice.rint(ang * 0.15915494309189535) if APPROX else tl.floor(ang * 0.15915494309189535 + 0.5)
    r = tl.fma(-k, 6.28125, ang)
    r = tl.fma(-k, 0.0019353071795864769, r)
    if APPROX:
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1)
    else:
        c = tl.cos(r)
        s = tl.sin(r)
    return c, s



def compiled_kernels(fn):
    """Every specialization of the jitted kernel ``fn`` compiled in this process, as
    ``(constexpr arguments by name, compiled kernel)`` pairs (diagnostics: which loop and
    launch configuration ran, registers, spills)."""
    for cache in getattr(fn, "device_caches", {}).values():
        for kern in cache[0].values():
            names = kern.src.fn.arg_names
            yield {names[k[0]] if isinstance(k, tuple) else k: v for k, v in kern.src.constants.items()}, kern


# APE-style context calibration (``paged_attention_triton(..., ctx_range=...)``): the
# attention kernels split each row's keys into two classes, the context keys of a row past
# the context (logits divided by the temperature) and all its other keys, and compute them
# in separate programs whose partials ``_merge_splits`` combines with the scaled context
# log-sum-exp. These helpers give a program its class's key tiles.
@triton.jit
def _ctx_entries(BLen_row, BPos_row, c0, c1, max_blocks, SCAN_BLOCK: tl.constexpr):
    """The table entries of one row that hold context keys (positions ``[c0, c1)``): the
    first and one past the last entry holding any, and the first, one past the last and the
    number of entries holding only context keys."""
    any_lo = max_blocks
    any_hi = max_blocks * 0
    full_lo = max_blocks
    full_hi = max_blocks * 0
    n_full = max_blocks * 0
    for e0 in range(0, max_blocks, SCAN_BLOCK):
        e = e0 + tl.arange(0, SCAN_BLOCK)
        em = e < max_blocks
        ln = tl.load(BLen_row + e, mask=em, other=0).to(tl.int32)
        bp = tl.load(BPos_row + e, mask=em, other=0).to(tl.int32)
        used = ln > 0
        hit = used & (bp < c1) & (bp + ln > c0)
        full = used & (bp >= c0) & (bp + ln <= c1)
        any_lo = tl.minimum(any_lo, _min(tl.where(hit, e, max_blocks), 0))
        any_hi = tl.maximum(any_hi, _max(tl.where(hit, e + 1, 0), 0))
        full_lo = tl.minimum(full_lo, _min(tl.where(full, e, max_blocks), 0))
        full_hi = tl.maximum(full_hi, _max(tl.where(full, e + 1, 0), 0))
        n_full = n_full + _sum(full.to(tl.int32), 0)
    return any_lo, any_hi, full_lo, full_hi, n_full


@triton.jit
def _ctx_split(BLen_row, BPos_row, c0, c1, max_blocks, r0, r1, split, num_splits, is_ctx, any_after, all_after,
               PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SCAN_BLOCK: tl.constexpr):
    """One split's share of its class's key tiles within ``[r0, r1)``.

    The context class (``is_ctx``) needs only the tiles of the entries holding context keys,
    and none when no row of the program is past the context (``any_after``). The other class
    needs them all but, when every row is past the context (``all_after``), the tiles inside
    a block of consecutive entries holding only context keys (the hole ``[h0, h0 + hole)``),
    which all its rows mask. The class's tiles are split evenly over ``num_splits``.
    ``is_ctx``, ``any_after``, ``all_after``: int32 flags (0 or 1).

    Returns ``(v0, v1, h0, hole)``: the split covers the virtual tiles ``[v0, v1)``, where a
    virtual tile ``v >= h0`` is the tile ``v + hole``. Exact for any table order."""
    any_lo, any_hi, full_lo, full_hi, n_full = _ctx_entries(BLen_row, BPos_row, c0, c1, max_blocks, SCAN_BLOCK)
    ct0 = (any_lo * PAGE_SIZE) // BLOCK_N
    ct1 = (any_hi * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N
    ctx = is_ctx != 0
    lo = tl.where(ctx, tl.maximum(r0, ct0), r0)
    hi = tl.where(ctx, tl.minimum(r1, ct1), r1)
    hi = tl.where(ctx & (any_after == 0), lo, hi)
    hi = tl.maximum(hi, lo)
    h0 = tl.minimum(tl.maximum((full_lo * PAGE_SIZE + BLOCK_N - 1) // BLOCK_N, lo), hi)
    h1 = tl.minimum(tl.maximum((full_hi * PAGE_SIZE) // BLOCK_N, h0), hi)
    has_hole = (is_ctx == 0) & (all_after != 0) & (n_full > 0) & (full_hi - full_lo == n_full)
    h0 = tl.where(has_hole, h0, hi)
    hole = tl.where(has_hole, h1 - h0, 0)
    n = hi - lo - hole
    per_split = (n + num_splits - 1) // num_splits
    v0 = tl.minimum(lo + split * per_split, lo + n)
    v1 = tl.minimum(v0 + per_split, lo + n)
    return v0, v1, h0, hole


@triton.jit
def _ctx_mask(seen, kpos, qpos, c0, c1, ape_ctx):
    """``seen`` ``(rows, keys)`` kept for the keys of this program's class: the context keys
    (positions ``[c0, c1)``) of the rows past the context (``qpos >= c1``) for the context
    class (``ape_ctx == 1``), every other key for the other class (``0``)."""
    inr = (qpos[:, None] >= c1) & ((kpos >= c0) & (kpos < c1))[None, :]
    return seen & (inr.to(tl.int32) == ape_ctx)
