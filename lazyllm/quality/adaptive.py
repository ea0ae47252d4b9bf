"""Adaptive recompute, measured: a request whose reuse pass leaves its first answer token
undecided (the top-2 probability margin of the prompt's last position below a threshold) is
answered by full attention instead; every other request keeps the reuse setting's answer.
With a window (``escalate_tokens``), the first tokens' margins count too: the lowest margin
up to the window or to the token where the setting's answer leaves full attention's,
whichever comes first (past that token a generation follows its own tokens, whose margins a
teacher-forced report does not see; its answer is already another).

The margin comes from the logits the reuse pass computes anyway, so the signal costs
nothing; an escalated request costs a full prefill of its documents. ``escalation_curve``
replays a fidelity report's per-case figures (``FidelityReport.cases``, each with its
``margin``) at a range of thresholds: full attention's own case is exact by definition (same
answer, KL 0, top-1 1), so the curve needs no further model runs. Each point is the mean
recompute (the fraction of chunk tokens computed with full context, escalated requests
counting all of theirs) against the metrics and their ratios to the order floor.
"""
from __future__ import annotations

from collections.abc import Sequence

from .floor import ratios, within_floor


def escalation_signal(case: dict, window: int = 1) -> float:
    """The margin a request is escalated by: the lowest of its first ``window`` answer
    tokens' margins, up to and including the first token where its answer leaves full
    attention's (``first_miss``)."""
    if window == 1:
        return case["margin"]
    margins = case["margins"]
    return min(margins[:max(1, min(window, case["first_miss"] + 1))])


def escalation_curve(cases: Sequence[dict], base: str, floor: dict,
                     fractions: Sequence[float] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5), *,
                     window: int = 1) -> list[dict]:
    """One point per fraction of requests escalated (the lowest signals first,
    ``escalation_signal`` over ``window`` answer tokens): the threshold, the mean
    recompute, top-1, KL and same-answer rate over ``base``'s cases, with their ratios to
    ``floor`` and whether the point is inside it. Raises ``ValueError`` when ``base`` has
    no cases or a case lacks the margins the window needs."""
    rows = [c for c in cases if c.get("setting") == base]
    if not rows:
        raise ValueError(f"no cases of setting {base!r} in the report")
    need = ("margin",) if window == 1 else ("margins", "first_miss")
    if any(c.get(k) is None for c in rows for k in need):
        raise ValueError(f"cases of {base!r} carry no {' or '.join(need)}: measure them again")
    signal = [escalation_signal(c, window) for c in rows]
    order = sorted(range(len(rows)), key=lambda i: signal[i])
    total_chunk = sum(c["chunk_tokens"] for c in rows) or 1
    points = []
    for frac in fractions:
        k = round(frac * len(rows))
        up = set(order[:k])
        tok = kl = top1 = rec = 0.0
        same = 0
        for i, c in enumerate(rows):
            n = len(c["ids"])
            tok += n
            if i in up:
                top1 += n
                same += 1
                rec += c["chunk_tokens"]
            else:
                kl += c["kl"] * n
                top1 += c["top1"] * n
                same += bool(c["same_answer"])
                rec += c["recomputed"]
        p = dict(setting=f"{base} + escalation", escalated=k / len(rows), escalated_n=k,
                 threshold=signal[order[k - 1]] if k else None, window=window, recomputed=rec / total_chunk,
                 top1=top1 / tok, kl=kl / tok, same_answer=same / len(rows), same_answer_n=same, cases=len(rows))
        if floor and floor.get("pairs"):
            p["ratios"] = ratios(p, floor)
            p["inside"] = within_floor(p, floor)
        points.append(p)
    return points


def curve_markdown(points: Sequence[dict]) -> str:
    """The curve as a Markdown table (ratios to the floor in brackets)."""
    lines = ["| escalated | margin below | recomputed | top-1 | mean KL | same first 8 tokens | inside the floor |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for p in points:
        q = p.get("ratios") or {}
        thr = "-" if p["threshold"] is None else f"{p['threshold']:.3f}"
        r = {k: f" ({q[k]:.2f}x)" if q.get(k) is not None else "" for k in ("top1", "kl", "same_answer")}
        lines.append(f"| {100 * p['escalated']:.0f}% ({p['escalated_n']}) | {thr} | {100 * p['recomputed']:.1f}% | "
                     f"{100 * p['top1']:.1f}%{r['top1']} | {p['kl']:.3f}{r['kl']} | "
                     f"{100 * p['same_answer']:.1f}%{r['same_answer']} | "
                     f"{'yes' if p.get('inside') else 'no'} |")
    return "\n".join(lines)


__all__ = ["curve_markdown", "escalation_curve", "escalation_signal"]
