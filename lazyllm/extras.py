"""Optional dependencies: one message, naming the extra to install, when one is missing.

The distribution is ``lazyattention`` (``lazyllm`` on the package index is an unrelated
project), installed from a clone: ``pip install -e ".[server]"``.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

# extra -> what it enables (for the message)
EXTRAS = {
    "server": "lazyllm serve, the OpenAI-compatible HTTP server",
    "ray": "replicas on Ray Serve (lazyllm.integrations.ray_serve)",
    "langchain": "the LangChain adapter (lazyllm.integrations.langchain)",
    "llama-index": "the LlamaIndex adapter (lazyllm.integrations.llama_index)",
    "chroma": "the chromadb helpers (lazyllm.integrations.chroma)",
    "bench": "plots (matplotlib)",
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message says which extra installs it."""


def install_hint(extra: str) -> str:
    return (f'pip install -e ".[{extra}]" from a clone of lazyllm (the distribution is named lazyattention; '
            f'"pip install lazyllm" installs an unrelated project)')


def require(extra: str, *modules: str, load: bool = True) -> None:
    """Import ``modules`` (``load=False``: only find them, which costs no import time); raise
    ``MissingExtraError`` naming ``extra`` when one is missing."""
    for name in modules:
        try:
            if load:
                importlib.import_module(name)
            elif importlib.util.find_spec(name) is None:
                raise ImportError(f"no module named {name!r}")
        except ImportError as e:
            raise MissingExtraError(f"{EXTRAS.get(extra, extra)} needs the {name!r} package: "
                                    f"{install_hint(extra)}") from e


def lazy_exports(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A package's ``__getattr__`` (PEP 562) that imports each name of ``exports`` from its
    module (``exports[name]``, relative to ``package`` when it starts with a dot) on first
    access and keeps it in the package, so importing the package imports none of them."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__all__ = ["EXTRAS", "MissingExtraError", "install_hint", "lazy_exports", "require"]
