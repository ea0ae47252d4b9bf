"""Shared pieces of the Triton kernels: the interpreter shim and small ``@triton.jit`` helpers.

Every kernel module of this package and the Gluon prefill import their helpers from here,
so both round the query rotation alike. Whether the kernels run in Triton's interpreter is
decided when this module is imported (``TRITON_INTERPRET=1`` then); see
``lazyllm.kernels.triton_kernels`` for how the interpreted copy is loaded.
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


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


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
