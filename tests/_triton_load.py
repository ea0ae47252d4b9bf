"""A private copy of a Triton kernel module, compiled or run in Triton's interpreter.

Triton picks the interpreter when a kernel is *defined*, so a test module that wants the
interpreter loads its own copy of the kernel file with ``TRITON_INTERPRET=1`` set only for
that import: the result does not depend on which test modules ran before, and the package's
own module (used by the engine) is untouched."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def load_kernel_module(filename: str, interpret: bool):
    name = f"_lazyllm_{Path(filename).stem}_{'interp' if interpret else 'compiled'}"
    old = os.environ.get("TRITON_INTERPRET")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        spec = importlib.util.spec_from_file_location(name, KERNELS / filename)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    return mod
