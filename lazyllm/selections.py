"""Quality recovery's token selections, a registry (``register_selection``): the engine
registers its own, a benchmark may register more, and the ``recompute_selection`` option is
checked against the names registered (and the built-in ones, valid before the engine that
registers them is imported). Plain Python, a leaf (``lazyllm.config`` re-exports it)."""
from __future__ import annotations

from collections.abc import Callable

BUILTIN_SELECTIONS = ("deviation", "attention", "two-stage")

# -- recovery selections ----------------------------------------------------------------
# name -> scorer(recovery, request, n_pick, exclude) -> (chunk tokens,) scores, higher first
_SELECTIONS: dict[str, Callable] = {}


def register_selection(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(recovery, request, n_pick, exclude)`` as the token selection
    ``name`` of quality recovery (``recompute_selection=name``). ``fn`` returns a score per
    chunk token of the request, in chunk order, ``(chunk tokens,)`` float; the ``n_pick``
    highest finite scores are recomputed. ``exclude`` (bool, chunk order, or ``None``) marks
    tokens that will not be picked whatever their score. Registering another function under
    a taken name raises ``ValueError``; the same function again is a no-op."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a selection name must be a non-empty str, got {name!r}")

    def add(fn: Callable) -> Callable:
        old = _SELECTIONS.get(name)
        if old is not None and old is not fn:
            raise ValueError(f"recovery selection {name!r} is already registered")
        _SELECTIONS[name] = fn
        return fn

    return add


def selection_names() -> tuple[str, ...]:
    """The registered recovery selections, in registration order."""
    return tuple(_SELECTIONS)


def selection(name: str) -> Callable:
    """The scorer registered as ``name`` (``KeyError`` if none)."""
    return _SELECTIONS[name]


__all__ = ["BUILTIN_SELECTIONS", "register_selection", "selection_names", "selection"]
