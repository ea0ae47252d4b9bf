"""The order floor: how much full attention's own answer moves when a case's documents come in
another order, the yardstick for a cache whose chunks do not know their neighbours.

A retriever hands over documents in an arbitrary order. Full attention is measured under
``k`` distinct other orders of each case's documents, teacher-forced on its greedy answer in
the case's own order, with the same metrics as every setting (top-1 agreement, KL, same
first tokens): that spread is the floor, and each setting is read as a ratio to it. The
mean of full attention's distributions over the orders (the case's and the ``k`` others) is
the best an order-independent cache can aim for; ``kl_mean`` is the KL from it.
"""
from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FLOOR_NAME = "order floor"


def other_orders(n: int, k: int, seed: int = 0) -> list[tuple[int, ...]]:
    """Up to ``k`` distinct permutations of ``range(n)``, none the identity: the reversed
    order, then rotations, then seeded shuffles (``min(k, n! - 1)`` of them)."""
    ident = tuple(range(n))
    total = math.factorial(n) - 1
    want = min(k, total)
    out: list[tuple[int, ...]] = []
    cands = itertools.chain([ident[::-1]], (ident[r:] + ident[:r] for r in range(1, n)))
    for p in cands:
        if len(out) < want and p != ident and p not in out:
            out.append(p)
    rng = random.Random(seed)
    while len(out) < want:
        p = tuple(rng.sample(ident, n))
        if p != ident and p not in out:
            out.append(p)
    return out


def mean_log_probs(logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """Log of the mean of ``softmax(l)`` over ``logits`` (each ``(positions, vocab)``): the
    order-mean distribution, float32."""
    import torch

    lp = torch.stack([torch.log_softmax(x.double(), dim=-1) for x in logits])
    return (torch.logsumexp(lp, dim=0) - math.log(len(logits))).float()


def kl_from_mean(mean_logp: torch.Tensor, logits: torch.Tensor) -> list[float]:
    """Per position, KL(order-mean || softmax(logits)) in nats."""
    import torch

    lp = mean_logp.double()
    lq = torch.log_softmax(logits.double(), dim=-1)
    return (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0).tolist()


def measure_floor(llm, cases, refs: list[dict], k: int, *, same_n: int, seed: int = 0, bar=None) -> dict:
    """Full attention (``llm``) in ``k`` other orders of each case's documents, against the
    case's own order (``refs``: per case ``ids`` and ``logits``). Adds ``mean_logp`` (the
    order-mean) and ``floor`` (per-case figures) to each ref; returns the floor's row (means
    over (case, order) pairs)."""
    from .metrics import kl_and_agreement

    kls, agrees, kl_means = [], [], []
    same = pairs = 0
    for i, (c, ref) in enumerate(zip(cases, refs)):
        logits = [ref["logits"]]
        case = dict(orders=0, same=0, kl=0.0, top1=0.0)
        for perm in other_orders(len(c.documents), k, seed + i):
            sc = llm.score(c.question, chunks=[c.documents[j] for j in perm], system=c.system,
                           continuation=ref["ids"], return_logits=True)
            kl, ag = kl_and_agreement(ref["logits"], sc.logits)
            kls += kl
            agrees += ag
            s = sc.logits.argmax(-1).tolist()[:same_n] == ref["ids"][:same_n]
            same += s
            pairs += 1
            case.update(orders=case["orders"] + 1, same=case["same"] + s, kl=case["kl"] + sum(kl) / len(kl),
                        top1=case["top1"] + sum(ag) / len(ag))
            logits.append(sc.logits)
        ref["mean_logp"] = mean_log_probs(logits)
        for x in logits[1:]:
            kl_means += kl_from_mean(ref["mean_logp"], x)
        ref["floor"] = case
        if bar is not None:
            bar.update(1)
    if not pairs:
        return dict(setting=FLOOR_NAME, orders=k, pairs=0, top1=None, kl=None, same_answer=None, kl_mean=None)
    return dict(setting=FLOOR_NAME, orders=k, pairs=pairs, cases=len(cases), tokens=len(kls),
                top1=sum(agrees) / len(agrees), kl=sum(kls) / len(kls), same_answer=same / pairs,
                same_answer_n=same, kl_mean=sum(kl_means) / len(kl_means))


def ratios(row: dict, floor: dict) -> dict:
    """A setting's metrics over the floor's: ``top1`` and ``same_answer`` (higher is
    better; 1 is the floor), ``kl`` (lower is better; 1 is the floor)."""
    out = {}
    for key in ("top1", "kl", "same_answer"):
        a, b = row.get(key), floor.get(key)
        out[key] = None if a is None or not b else a / b
    return out


def within_floor(row: dict, floor: dict, kl_factor: float = 2.0) -> bool:
    """The rule that chooses defaults: same-answer rate at least the floor's and KL at most
    ``kl_factor`` times the floor's."""
    if floor.get("same_answer") is None:
        return False
    return row["same_answer"] >= floor["same_answer"] and row["kl"] <= kl_factor * floor["kl"]


__all__ = ["FLOOR_NAME", "kl_from_mean", "mean_log_probs", "measure_floor", "other_orders", "ratios",
           "within_floor"]
