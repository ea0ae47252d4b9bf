"""Loading the Triton kernels: compiled for CUDA, or a private copy run in Triton's interpreter.

``lazyllm.kernels`` (the folder ``kernels/``) holds the deferred-RoPE paged attention
kernels and their plain-torch twins. It is a namespace package: the folder has no
``__init__.py``, so a Python started at the repository's root never takes it for another
installed package called ``kernels`` (Hugging Face's, which transformers imports).
``reference`` is the specification and the CPU path. The Triton kernels live in the
subpackage ``triton`` and are imported on first use (``triton_kernels()``), so
``lazyllm.kernels`` imports without Triton.
``triton_kernels(interpret=True)`` gives a private copy of that subpackage run in Triton's
interpreter, which the engine's Triton backend uses on CPU. ``KernelOptions`` holds the
launch choices that are not the engine's (loops, configurations, splits, the Gluon switch);
users reach it as ``lazyllm.KernelOptions``.
"""
import threading

_TRITON_PACKAGE = "triton"  # the subpackage of the Triton kernels
_INTERPRETED = None  # the private interpreted copy of the subpackage, once loaded
_COPIES = [0]  # private copies loaded so far (each gets its own module name)
_LOCK = threading.RLock()
_PACKAGE = __name__.rpartition(".")[0]  # lazyllm.kernels


class _TritonInterpret:
    """``TRITON_INTERPRET`` set (``interpret``) or unset while a copy imports: Triton picks
    the interpreter when a kernel is *defined*."""

    def __init__(self, interpret: bool):
        self.interpret = interpret

    def __enter__(self):
        import os

        self.old = os.environ.get("TRITON_INTERPRET")
        if self.interpret:
            os.environ["TRITON_INTERPRET"] = "1"
        else:
            os.environ.pop("TRITON_INTERPRET", None)

    def __exit__(self, *exc):
        import os

        if self.old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = self.old


def load_private_copy(name: str, interpret: bool):
    """A fresh private copy of this package's Triton kernels, compiled or run in Triton's
    interpreter: ``"triton"`` (the whole kernel subpackage) or ``"fused.py"`` (one module).

    The copy is imported under a private module name with ``TRITON_INTERPRET`` set (or
    unset) for that import only; a package copy imports all its kernel modules then, and
    its relative imports resolve inside the copy. So the result does not depend on what was
    imported before, never shares a module with the package's own (compiled) kernels, and
    leaves those untouched."""
    import importlib.util
    import os
    import sys

    here = os.path.dirname(__file__)
    stem = os.path.splitext(os.path.basename(name))[0]
    with _LOCK:
        _COPIES[0] += 1
        priv = f"{_PACKAGE}._{stem}_{'interpreted' if interpret else 'compiled'}_{_COPIES[0]}"
        path = os.path.join(here, name)
        if os.path.isdir(path):
            spec = importlib.util.spec_from_file_location(priv, os.path.join(path, "__init__.py"),
                                                          submodule_search_locations=[path])
        else:
            spec = importlib.util.spec_from_file_location(priv, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[priv] = mod  # the copy's relative imports find their package here
        with _TritonInterpret(interpret):
            try:
                spec.loader.exec_module(mod)
            except BaseException:
                for key in [k for k in sys.modules if k == priv or k.startswith(priv + ".")]:
                    del sys.modules[key]
                raise
    return mod


def triton_kernels(interpret: bool = False):
    """The Triton kernels (imports Triton; ``ImportError`` where it is missing), as a module
    exposing ``paged_attention_triton``, ``grouped_attention_triton``,
    ``paged_attention_mass_triton``, ``rerotate_copy_triton``, ``write_kv_triton``,
    ``rope_table`` and ``delta_runs``.

    ``interpret=False``: the package's ``lazyllm.kernels.triton`` (compiled kernels, for
    CUDA). ``interpret=True``: one private copy of the same subpackage whose kernels run in
    Triton's interpreter (for CPU; ``load_private_copy``), loaded once: either is right
    whatever was imported before, and neither changes the other."""
    global _INTERPRETED
    import importlib
    import sys

    with _LOCK:
        if not interpret:
            full = f"{_PACKAGE}.{_TRITON_PACKAGE}"
            if full in sys.modules:
                return sys.modules[full]
            with _TritonInterpret(False):
                return importlib.import_module(full)
        if _INTERPRETED is None:
            _INTERPRETED = load_private_copy(_TRITON_PACKAGE, interpret=True)
        return _INTERPRETED
