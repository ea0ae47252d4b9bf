"""Triton's kernel cache and the kernels compiled after an engine is ready.

``default_triton_cache()`` keeps Triton's cache in lazyllm's cache folder, so a second
process loads the kernels the first one compiled. ``COMPILES`` counts Triton compilations
(its ``jit_post_compile_hook``) and the ones after an engine was ready, each logged as a
warning with the kernel's name.
"""
from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager

from ...model.loader import cache_root

log = logging.getLogger("lazyllm")


# -- Triton's cache -------------------------------------------------------------------------
def default_triton_cache() -> str | None:
    """Triton's kernel cache folder: ``TRITON_CACHE_DIR`` where the user set it, else
    ``triton/`` in lazyllm's cache folder (``LAZYLLM_CACHE``, default ``~/.cache/lazyllm``),
    which is then set as ``TRITON_CACHE_DIR`` for this process and the ones it starts
    (tensor-parallel workers), so the next process loads what this one compiled. ``None``
    where that folder cannot be made (Triton's own default then stays)."""
    path = os.environ.get("TRITON_CACHE_DIR")
    if not path:
        path = str(cache_root() / "triton")
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:  # a read-only home, say: Triton keeps its own default
            log.warning("cannot use %s for Triton's kernel cache (%s); Triton's default stays", path, e)
            return None
        os.environ["TRITON_CACHE_DIR"] = path
    return path


# -- kernels compiled after ready ----------------------------------------------------------
class CompileWatch:
    """Counts Triton kernel compilations in this process: Triton calls
    ``knobs.runtime.jit_post_compile_hook`` once per new specialization it compiles (or loads
    from its disk cache), Gluon kernels included. A compilation while some engine is ready and
    none is warming up counts as *after ready* and is logged as a warning naming the kernel: a
    request waited for it. A hook the user set before is kept and called too."""

    def __init__(self):
        self._lock = threading.Lock()
        self.compiled = 0  # specializations compiled or loaded by this process
        self.after_ready = 0  # of those, while an engine was ready and none was warming up
        self._ready = 0  # engines whose warm-up finished (or that were made without one)
        self._warming = 0  # warm-ups running now
        self._previous = None
        self.installed = False

    def install(self) -> bool:
        """Hook Triton's compiler (once); ``False`` where this Triton has no such hook."""
        with self._lock:
            if self.installed:
                return True
            try:
                from triton import knobs

                runtime = knobs.runtime
                self._previous = runtime.jit_post_compile_hook
            except (ImportError, AttributeError):
                return False
            runtime.jit_post_compile_hook = self.hook
            self.installed = True
            return True

    def hook(self, *, fn=None, repr=None, **kw):
        """Triton's ``JITHook`` signature (``key``, ``repr``, ``fn``, ``compile``,
        ``is_manual_warmup``, ``already_compiled``)."""
        name = f"{getattr(fn, 'module', '?')}.{getattr(fn, 'name', '?')}" if fn is not None else "?"
        self.record(name, describe(kw.get("compile")) or repr or "")
        if self._previous is not None:
            return self._previous(fn=fn, repr=repr, **kw)
        return None

    def record(self, name: str, detail: str = "") -> bool:
        """Count one compilation of kernel ``name``; ``True`` if it came after ready."""
        with self._lock:
            self.compiled += 1
            late = self._ready > 0 and self._warming == 0
            self.after_ready += late
        if late:
            # the whole specialization: which argument's value or alignment was new is at its end
            log.warning("Triton compiled kernel %s after the engine was ready (a request waited for it): %s",
                        name, " ".join(detail.split()))
        return late

    @contextmanager
    def warming(self):
        """Compilations inside are the warm-up's, not late ones."""
        with self._lock:
            self._warming += 1
        try:
            yield
        finally:
            with self._lock:
                self._warming -= 1

    def mark_ready(self) -> int:
        """An engine is ready; returns the after-ready count to subtract from later ones."""
        with self._lock:
            self._ready += 1
            return self.after_ready

    def mark_closed(self) -> None:
        with self._lock:
            self._ready = max(0, self._ready - 1)


def describe(compile: dict | None) -> str:
    """A compiled specialization, argument by argument, from the ``compile`` record Triton
    hands its hooks: each constexpr's value, each other argument's type and the attributes
    Triton specialized it on (``tt.divisibility=16``: a pointer 16-byte aligned, an integer
    a multiple of 16). Triton's own ``repr`` cannot serve: Triton 3.6 builds it from one
    character of the cache key, so it names the first argument only."""
    if not isinstance(compile, dict) or not isinstance(compile.get("signature"), dict):
        return ""
    consts = compile.get("constants") or {}
    configs = compile.get("configs") or [{}]
    attrs = configs[0] if isinstance(configs[0], dict) else {}
    out = []
    for i, (name, ty) in enumerate(compile["signature"].items()):
        if ty == "constexpr":
            out.append(f"{name}={consts.get((i,))!r}")
            continue
        a = attrs.get((i,))
        try:
            tags = ",".join(f"{k}={v}" for k, v in a) if a else ""
        except (TypeError, ValueError):  # attributes of another shape: as they are
            tags = repr(a)
        out.append(f"{name}:{ty}" + (f"[{tags}]" if tags else ""))
    return ", ".join(out)


COMPILES = CompileWatch()


__all__ = ["COMPILES", "CompileWatch", "default_triton_cache", "describe"]
