"""The fidelity report's and ``adapt``'s argument checks, and the defaults the command lines
show: light to import (no torch, no model), so ``lazyllm adapt`` and ``python -m
lazyllm.quality`` refuse a bad argument before they import the engine, load a model, build a
case or take a training step."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import InvalidRequestError
from ..presets import PRESETS

# LazyLLM()'s own (today balanced's values), the two that recompute nothing, and full attention
DEFAULT_SETTINGS: tuple[str, ...] = ("default", "isolated", "fast", "exact")
# ``adapt``'s defaults (its signature uses these; the command line shows them)
ADAPT_DEFAULTS: dict[str, Any] = dict(k_header=8, k_trailer=8, cases=80, heldout=0.2, heldout_cases=16,
                                      docs_per_case=4, steps=120, minutes=15.0, lr=1e-2, questions="templates")


def check_settings(settings: Any) -> list[tuple[str, dict]]:
    """``[(name, LazyLLM kwargs)]`` of ``compare``'s ``settings`` argument; raises
    ``ValueError`` for an unknown setting name and ``InvalidRequestError`` for options
    ``LazyLLM`` would refuse."""
    if settings is None:
        settings = DEFAULT_SETTINGS
    if isinstance(settings, Mapping):
        items = list(settings.items())
    else:
        items = []
        for s in settings:
            items.append((s, None) if isinstance(s, str) else tuple(s))
    out = []
    for name, kw in items:
        if kw is None:
            if name == "default":
                kw = {}
            elif name in PRESETS:
                kw = {"quality": name}
            else:
                raise ValueError(f"unknown setting {name!r}: a preset {tuple(PRESETS)}, 'default', or give "
                                 f"(name, LazyLLM kwargs)")
        _check_setting(name, kw)
        out.append((name, dict(kw)))
    return out


def _check_setting(name: str, kw: Any) -> None:
    """Raise for a setting ``LazyLLM`` would refuse, before any model loads or case runs."""
    from ..config import EngineConfig

    if not isinstance(kw, Mapping):
        raise InvalidRequestError(f"setting {name!r}: its options must be a dict of LazyLLM keyword arguments")
    try:
        EngineConfig.resolve(kw.get("quality"), **{k: v for k, v in kw.items() if k != "quality"})
    except InvalidRequestError as e:
        raise InvalidRequestError(f"setting {name!r}: {e}") from None


def check_recipe(*, k_header: int, k_trailer: int, cases: int, heldout: float, heldout_cases: int,
                 docs_per_case: int, steps: int, minutes: float | None, lr: float,
                 out: str | os.PathLike) -> None:
    """Raise ``InvalidRequestError`` naming every argument of ``adapt`` that cannot train a
    packet, before any model loads or any case is built (training takes minutes; a bad
    argument should cost none of them)."""
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    bad = [f"{name} must be an int >= 0, got {v!r}" for name, v in (("k_header", k_header), ("k_trailer", k_trailer))
           if not whole(v) or v < 0]
    if not bad and k_header + k_trailer == 0:
        bad.append("k_header + k_trailer must be at least 1: a packet of no embeddings trains nothing")
    bad += [f"{name} must be an int >= 1, got {v!r}" for name, v in (
        ("cases", cases), ("heldout_cases", heldout_cases), ("docs_per_case", docs_per_case), ("steps", steps))
        if not whole(v) or v < 1]
    if not number(heldout) or not 0 < heldout < 1:
        bad.append(f"heldout must be a fraction in (0, 1), got {heldout!r}")
    if minutes is not None and (not number(minutes) or minutes <= 0):
        bad.append(f"minutes must be a positive number or None, got {minutes!r}")
    if not number(lr) or lr <= 0:
        bad.append(f"lr must be a positive number, got {lr!r}")
    folder = Path(os.fspath(out)).expanduser().parent
    if not folder.is_dir():
        bad.append(f"out: the folder {str(folder)!r} does not exist")
    if bad:
        raise InvalidRequestError("; ".join(bad))


__all__ = ["ADAPT_DEFAULTS", "DEFAULT_SETTINGS", "check_recipe", "check_settings"]
