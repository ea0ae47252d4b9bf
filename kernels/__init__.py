"""Deferred-RoPE paged attention kernels (Triton) and their plain-torch twins.

Installed as ``lazyllm.kernels``. ``reference`` is the specification and the CPU path.
``triton_attention`` holds the Triton kernels; it is imported on first use (through
``get_backend("triton")`` or the attribute), so this package imports without Triton.
``gluon_prefill`` holds a warp-specialized prefill for Hopper GPUs, written in Gluon;
``paged_attention_triton`` sends prefill there on Hopper when the caller passes
``padding_finite=True`` (the engine does), and imports it only then.
"""
from .reference import (  # noqa: F401
    apply_rope,
    paged_attention_ref,
    rerotate_copy_ref,
    rope_cos_sin,
    rotate_by_delta,
    write_kv_ref,
)

_TRITON_NAMES = ("paged_attention_triton", "rerotate_copy_triton", "write_kv_triton", "rope_table")


def get_backend(name: str = "torch"):
    """``(paged_attention, rerotate_copy, write_kv)`` of backend ``"torch"`` (the reference)
    or ``"triton"`` (imports Triton; raises ``ImportError`` where it is missing)."""
    if name == "torch":
        return paged_attention_ref, rerotate_copy_ref, write_kv_ref
    if name == "triton":
        from . import triton_attention as ta

        return ta.paged_attention_triton, ta.rerotate_copy_triton, ta.write_kv_triton
    raise ValueError(f"unknown kernel backend {name!r}; use 'torch' or 'triton'")


def __getattr__(name):  # lazy: `lazyllm.kernels.paged_attention_triton` imports Triton here
    if name == "triton_attention" or name in _TRITON_NAMES:
        import importlib

        ta = importlib.import_module(".triton_attention", __name__)
        return ta if name == "triton_attention" else getattr(ta, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
