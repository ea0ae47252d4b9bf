"""Deferred-RoPE paged attention kernels (Triton) and their plain-torch twins.

Installed as ``lazyllm.kernels``. ``reference`` is the specification and the CPU path.
``triton_attention`` holds the Triton kernels; it is imported on first use (through
``get_backend("triton")``, ``triton_kernels()`` or the attribute), so this package imports
without Triton. ``triton_kernels(interpret=True)`` gives a private copy run in Triton's
interpreter, which the engine's Triton backend uses on CPU.
``gluon_prefill`` holds a warp-specialized prefill for Hopper GPUs, written in Gluon;
``paged_attention_triton`` sends prefill there on Hopper when the caller passes
``padding_finite=True`` (the engine does), and imports it only then.
"""
import threading

from .reference import (  # noqa: F401
    apply_rope,
    paged_attention_ref,
    rerotate_copy_ref,
    rope_cos_sin,
    rotate_by_delta,
    write_kv_ref,
)

_TRITON_NAMES = ("paged_attention_triton", "rerotate_copy_triton", "write_kv_triton", "rope_table")
_INTERPRETED = None  # the private interpreted copy of triton_attention, once loaded
_INTERPRETED_LOCK = threading.Lock()


def load_private_copy(filename: str, interpret: bool):
    """A private copy of one of this package's Triton kernel files (``"triton_attention.py"``,
    ``"fused.py"``), its kernels compiled or run in Triton's interpreter. Triton picks the
    interpreter when a kernel is *defined*, so the copy is loaded with ``TRITON_INTERPRET``
    set (or unset) for that import only: the result does not depend on what was imported
    before, and the package's own modules are untouched."""
    import importlib.util
    import os

    stem = os.path.splitext(os.path.basename(filename))[0]
    name = f"{__name__}._{stem}_{'interpreted' if interpret else 'compiled'}"
    old = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), filename))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod


def triton_kernels(interpret: bool = False):
    """The Triton kernel module (imports Triton; ``ImportError`` where it is missing).

    ``interpret=False``: the package's ``triton_attention`` (compiled kernels, for CUDA).
    ``interpret=True``: one private copy of the same file whose kernels run in Triton's
    interpreter (for CPU; ``load_private_copy``), loaded once: either module is right
    whatever was imported before, and neither changes the other."""
    if not interpret:
        import importlib

        return importlib.import_module(".triton_attention", __name__)
    global _INTERPRETED
    with _INTERPRETED_LOCK:
        if _INTERPRETED is None:
            _INTERPRETED = load_private_copy("triton_attention.py", interpret=True)
        return _INTERPRETED


def get_backend(name: str = "torch"):
    """``(paged_attention, rerotate_copy, write_kv)`` of backend ``"torch"`` (the reference)
    or ``"triton"`` (imports Triton; raises ``ImportError`` where it is missing)."""
    if name == "torch":
        return paged_attention_ref, rerotate_copy_ref, write_kv_ref
    if name == "triton":
        ta = triton_kernels()
        return ta.paged_attention_triton, ta.rerotate_copy_triton, ta.write_kv_triton
    raise ValueError(f"unknown kernel backend {name!r}; use 'torch' or 'triton'")


def __getattr__(name):  # lazy: `lazyllm.kernels.paged_attention_triton` imports Triton here
    if name == "triton_attention" or name in _TRITON_NAMES:
        ta = triton_kernels()
        return ta if name == "triton_attention" else getattr(ta, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
