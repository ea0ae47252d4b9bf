"""Fidelity metrics: per-position KL and top-1 agreement against full attention, answer
matching against a reference, and the target a setting must meet."""
from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: parse_target serves the command line before torch loads
    import torch

# what a setting must reach to be recommended when the caller names no target
DEFAULT_TARGET: dict[str, float] = {"top1": 0.97, "kl": 0.01, "same_answer": 0.9}
# metrics a target may name; True: higher is better
HIGHER_IS_BETTER = {"top1": True, "kl": False, "same_answer": True, "exact_match": True, "contains": True,
            "recomputed": False, "ttft_ms": False}
# the metrics that are fractions in [0, 1]
_FRACTIONS = ("top1", "same_answer", "exact_match", "contains", "recomputed")
_ALIASES = {"same": "same_answer", "em": "exact_match", "exact": "exact_match", "top-1": "top1",
            "agreement": "top1", "recompute": "recomputed", "ttft": "ttft_ms"}


def kl_and_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[list[float], list[bool]]:
    """Per position: KL(softmax(ref) || softmax(logits)) in nats (float64), and whether the
    two argmaxes agree. Both ``(positions, vocab)``."""
    import torch

    lp = torch.log_softmax(ref_logits.double(), dim=-1)
    lq = torch.log_softmax(logits.double(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)  # >= 0 up to float64 rounding
    agree = ref_logits.argmax(-1) == logits.argmax(-1)
    return kl.tolist(), agree.tolist()


def answer_margins(logits: torch.Tensor) -> list[float]:
    """Per answer position (rows of logits ``(n, vocab)``): the probability of the most
    likely next token minus the second's, the margin the engine's ``escalate_below``
    compares (``lazyllm.engine.running.sampler.top2_margins``), so a report replays what the engine
    decides."""
    from ..engine.running.sampler import top2_margins

    return top2_margins(logits).tolist()


def normalize_answer(text: str) -> str:
    """SQuAD-style normalization: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(answer: str, reference: str) -> bool:
    """The normalized answer, or its first sentence, equals the normalized reference (so a
    short reference such as "4821" matches "4821. The code opens vault 17.")."""
    r = normalize_answer(reference)
    first = re.split(r"(?<=[.!?])\s|\n", answer.strip(), maxsplit=1)[0]
    return normalize_answer(answer) == r or normalize_answer(first) == r


def contains_answer(answer: str, reference: str) -> bool:
    """The normalized reference appears in the normalized answer (a lenient exact match for
    answers that are sentences)."""
    r = normalize_answer(reference)
    return bool(r) and f" {r} " in f" {normalize_answer(answer)} "


def parse_target(target: str | Mapping[str, float] | None) -> dict[str, float]:
    """``{"top1": 0.97, "kl": 0.01}`` or ``"top1>=0.97,kl<=0.01,same>=0.9"`` (``=`` works
    too: the direction is the metric's own). Names: top1, kl, same_answer (same), exact_match
    (em), recomputed, ttft_ms. Raises ``ValueError`` for a target no setting can meet (a
    fraction outside [0, 1], ``top1=97`` for 97%, a negative KL)."""
    if target is None:
        return dict(DEFAULT_TARGET)
    if isinstance(target, str):
        items = {}
        for part in filter(None, (p.strip() for p in target.split(","))):
            m = re.fullmatch(r"([A-Za-z_\-0-9]+)\s*(>=|<=|=)\s*([0-9.eE+-]+)", part)
            if not m:
                raise ValueError(f"target part {part!r}: expected name>=value or name<=value")
            items[m.group(1)] = float(m.group(3))
        target = items
    out = {}
    for k, v in target.items():
        k = _ALIASES.get(k, k)
        if k not in HIGHER_IS_BETTER:
            raise ValueError(f"unknown target metric {k!r}; one of {sorted(HIGHER_IS_BETTER)}")
        v = float(v)
        if k in _FRACTIONS and not 0.0 <= v <= 1.0:
            hint = f" (a fraction: {v / 100:g} for {v:g}%)" if 1.0 < v <= 100.0 else ""
            raise ValueError(f"target {k}={v:g} can never be met: {k} is in [0, 1]{hint}")
        if v < 0 or v != v:
            raise ValueError(f"target {k}={v:g} can never be met: {k} is >= 0")
        out[k] = v
    return out


def check_target(row: dict, target: dict[str, float]) -> dict[str, bool]:
    out = {}
    for k, v in target.items():
        x = row.get(k)
        out[k] = x is not None and ((x >= v) if HIGHER_IS_BETTER[k] else (x <= v))
    return out


