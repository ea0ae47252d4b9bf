"""A private copy of the Triton kernels, compiled or run in Triton's interpreter.

Triton picks the interpreter when a kernel is *defined*, so a test module that wants the
interpreter loads its own copy (``"triton"``: the kernel package ``kernels/triton/``;
``"fused.py"``) with ``TRITON_INTERPRET=1`` set only for that import
(``lazyllm.kernels.loader.load_private_copy``): the result does not depend on which test modules
ran before, and the package's own modules (used by the engine) are untouched."""
from __future__ import annotations

from lazyllm.kernels.loader import load_private_copy


def load_kernel_module(name: str, interpret: bool):
    return load_private_copy(name, interpret)
