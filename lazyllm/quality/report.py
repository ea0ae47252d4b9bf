"""The fidelity report: full attention and each candidate setting run on the same cases
(``compare``), and the per-setting table, plot and recommendation (``FidelityReport``)."""
from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ..api import LazyLLM
from ..extras import require
from ..presets import QUALITY_OPTIONS
from .cases import Case, as_cases
from .checks import check_settings as _settings
from .floor import FLOOR_NAME, kl_from_mean, measure_floor, ratios, within_floor
from .metrics import (
    HIGHER_IS_BETTER,
    answer_margins,
    check_target,
    contains_answer,
    exact_match,
    kl_and_agreement,
    parse_target,
)

# the candidates compared when the caller names none: the default and the presets
REFERENCE_NAME = "full attention"
# what recommend() answers when no setting meets the target: full attention's answers, as a
# preset LazyLLM(quality=...) takes
FALLBACK = "exact"
# full attention with identical-prefix reuse: the reference's score after its greedy answer
# finds the prompt cached and computes only the answer's tokens
_FULL = {"reuse": "prefix"}


# -- report --------------------------------------------------------------------------------
@dataclass
class FidelityReport:
    """Per-setting fidelity to full attention. ``rows``: one dict per setting (the first is
    full attention itself); ``cases``: per-case details; ``target``: what ``recommend`` checks
    by default."""

    rows: list[dict]
    target: dict[str, float]
    model: str = ""
    n_cases: int = 0
    answer_tokens: int = 0
    same_answer_tokens: int = 0
    cases: list[dict] = field(default_factory=list)
    floor: dict | None = None

    @property
    def table(self):
        """The rows as a ``pandas.DataFrame`` when pandas is installed, else a list of dicts."""
        cols = ["setting", "top1", "kl", "same_answer", "exact_match", "contains", "recomputed", "ttft_ms",
                "meets_target"]
        rows = [{c: r.get(c) for c in cols} for r in self.rows]
        try:
            import pandas as pd
        except ImportError:
            return rows
        return pd.DataFrame(rows).set_index("setting")

    def row(self, name: str) -> dict:
        for r in self.rows:
            if r["setting"] == name:
                return r
        raise KeyError(name)

    def __str__(self) -> str:
        return self.to_markdown()

    def recommend(self, target: str | Mapping[str, float] | None = None) -> str:
        """The cheapest setting (fewest chunk tokens recomputed, then lowest TTFT) that meets
        ``target`` (default: the report's); ``"exact"`` (the preset that gives full
        attention's answers, ``LazyLLM(quality="exact")``) when no reusing setting does."""
        t = self.target if target is None else parse_target(target)
        ok = [r for r in self.rows if r["setting"] != REFERENCE_NAME and all(check_target(r, t).values())]
        if not ok:
            return FALLBACK
        ok.sort(key=lambda r: (r["recomputed"], r["ttft_ms"] if r["ttft_ms"] is not None else math.inf))
        return ok[0]["setting"]

    def floor_choice(self, kl_factor: float = 2.0) -> str | None:
        """The cheapest setting (as ``recommend`` orders them) whose same-answer rate is at
        least the order floor's and whose KL is at most ``kl_factor`` times the floor's;
        ``"exact"`` when none is; ``None`` without a floor."""
        if not self.floor or self.floor.get("same_answer") is None:
            return None
        ok = [r for r in self.rows if r["setting"] != REFERENCE_NAME and within_floor(r, self.floor, kl_factor)]
        ok.sort(key=lambda r: (r["recomputed"], r["ttft_ms"] if r["ttft_ms"] is not None else math.inf))
        return ok[0]["setting"] if ok else FALLBACK

    def floor_markdown(self) -> str:
        """Per metric, the order floor and each setting's ratio to it, and the KL to the
        order-mean of full attention; empty without a floor."""
        f = self.floor
        if not f or f.get("same_answer") is None:
            return ""

        def x(v):
            return "-" if v is None else f"{v:.2f}x"

        lines = ["| setting | top-1 agreement | mean KL | same answer | KL to order-mean |",
                 "| --- | ---: | ---: | ---: | ---: |",
                 f"| {FLOOR_NAME} ({f['orders']} other orders, {f['pairs']} pairs) | {100 * f['top1']:.1f}% | "
                 f"{f['kl']:.4f} | {100 * f['same_answer']:.1f}% ({f['same_answer_n']}/{f['pairs']}) | "
                 f"{f['kl_mean']:.4f} |"]
        for r in self.rows:
            q = ratios(r, f)
            km = "-" if r.get("kl_mean") is None else f"{r['kl_mean']:.4f}"
            lines.append(f"| {r['setting']} | {x(q['top1'])} | {x(q['kl'])} | {x(q['same_answer'])} | {km} |")
        return "\n".join(lines) + (
            "\n\nRatios to the order floor (full attention in other orders of the same documents, teacher-forced on "
            "its answer in the case's order): top-1 and same answer above 1 and KL below 1 are inside it. Within "
            f"the floor (same answer >= the floor's, KL <= 2x the floor's), cheapest: **{self.floor_choice()}**.")

    def to_dict(self) -> dict:
        return dict(model=self.model, n_cases=self.n_cases, answer_tokens=self.answer_tokens,
                    same_answer_tokens=self.same_answer_tokens, target=self.target,
                    recommendation=self.recommend(), floor=self.floor, floor_choice=self.floor_choice(),
                    rows=self.rows, cases=self.cases)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        s = json.dumps(self.to_dict(), indent=2, default=str)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(s)
        return s

    def to_markdown(self) -> str:
        def pct(x):
            return "-" if x is None else f"{100 * x:.1f}%"

        t = self.target
        lines = ["| setting | top-1 agreement | mean KL | same answer | exact match | contains answer | recomputed "
                 "| TTFT ms | meets target |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in self.rows:
            ttft = "-" if r["ttft_ms"] is None else f"{r['ttft_ms']:.1f}"
            same = f"{pct(r['same_answer'])} ({r['same_answer_n']}/{r['cases']})"
            meets = "yes" if r["meets_target"] else "no (" + ", ".join(
                k for k, v in check_target(r, t).items() if not v) + ")"
            n_ref = r.get("references") or 0
            em = "-" if not n_ref else f"{pct(r['exact_match'])} ({round(r['exact_match'] * n_ref)}/{n_ref})"
            cont = "-" if not n_ref else f"{pct(r.get('contains'))} ({round(r['contains'] * n_ref)}/{n_ref})"
            lines.append(f"| {r['setting']} | {pct(r['top1'])} | {r['kl']:.4f} | {same} | "
                         f"{em} | {cont} | {pct(r['recomputed'])} | {ttft} | {meets} |")
        tgt = ", ".join(f"{k} {'>=' if HIGHER_IS_BETTER[k] else '<='} {v:g}" for k, v in t.items())
        rec = self.recommend()
        refs = max((r.get("references") or 0 for r in self.rows), default=0)
        return "\n".join(lines) + (
            f"\n\n{self.n_cases} cases, {self.model}; teacher-forced on full attention's greedy answer "
            f"({self.answer_tokens} tokens at most); same answer: first {self.same_answer_tokens} tokens; "
            f"exact match and contains answer over the {refs} cases with a reference. "
            f"Target: {tgt}. Recommended: **{rec}**"
            + (" (no setting that reuses chunk KV meets the target: full attention's answers, "
               "quality=\"exact\")" if not any(r["setting"] == rec and r["meets_target"] for r in self.rows)
               else "") + ".")

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def full_markdown(self) -> str:
        """The table, then the order floor's (when measured)."""
        fl = self.floor_markdown()
        return self.to_markdown() + (f"\n\n{fl}" if fl else "")

    def plot(self, ax=None, path: str | os.PathLike | None = None):
        """Top-1 agreement and same-answer rate against recomputed chunk tokens, one point
        per setting, the target's lines dashed. Returns the matplotlib figure."""
        require("bench", "matplotlib")
        import matplotlib.pyplot as plt

        fig = None
        if ax is None:
            fig, ax = plt.subplots(figsize=(6, 3.5))
        else:
            fig = ax.figure
        xs = [100 * r["recomputed"] for r in self.rows]
        ax.scatter(xs, [100 * r["top1"] for r in self.rows], label="top-1 agreement", marker="o")
        ax.scatter(xs, [100 * r["same_answer"] for r in self.rows], label="same answer", marker="s")
        for x, r in zip(xs, self.rows):
            ax.annotate(r["setting"], (x, 100 * r["top1"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        for k, style in (("top1", "C0"), ("same_answer", "C1")):
            if k in self.target:
                ax.axhline(100 * self.target[k], ls="--", lw=0.8, color=style)
        ax.set_xlabel("chunk tokens recomputed (%)")
        ax.set_ylabel("% of full attention")
        ax.set_title(f"Fidelity to full attention ({self.n_cases} cases)")
        ax.legend(fontsize=8, loc="lower right")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=120)
        return fig


# -- measurement -------------------------------------------------------------------------
def _score(llm: LazyLLM, cases: list[Case], conts: list[list[int]] | None, workers: int, answer_tokens: int):
    """Per case ``(greedy answer or None, ScoreOutput)``: where ``conts`` is None (full
    attention) the greedy answer first, then the score of it over the very prompt it kept;
    else the documents cached on their own first (``llm.warm``, as in serving: the request
    then reuses them at other positions and next to other documents), then the score of
    ``conts[i]``. One case at a time end to end, so a small page pool holds what it reuses."""
    def one(i):
        c = cases[i]
        gen = None
        if conts is None:
            gen = llm.generate(c.question, chunks=c.documents, system=c.system, max_new_tokens=answer_tokens)
            cont = list(gen.token_ids) or [llm.tokenizer.eos_token_id]
        else:
            cont = conts[i]
            if llm.engine.planner.caches_chunks:
                llm.warm(c.documents, system=c.system, progress=False)
        return gen, llm.score(c.question, chunks=c.documents, system=c.system, continuation=cont,
                              return_logits=True)

    if workers <= 1:
        return [one(i) for i in range(len(cases))]
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, range(len(cases))))


def _ttft(llm: LazyLLM, c: Case) -> float:
    """TTFT of one case as a new request sees it: its documents cached where the setting
    caches chunks (``_score`` warmed them), the prompt computed afresh where it reuses only an identical
    prefix (the scoring passes just computed this very prompt, which a new question would not
    find)."""
    if not llm.engine.planner.caches_chunks:
        llm.clear_cache()
    return llm.generate(c.question, chunks=c.documents, system=c.system, max_new_tokens=1).ttft_s


def _measure(llm: LazyLLM, name: str, kwargs: dict, cases: list[Case], refs: list[dict], *, same_n: int,
             ttft_cases: int, workers: int, generate_answers: bool, answer_tokens: int, bar) -> tuple[dict, list]:
    is_ref = refs is None
    pairs = _score(llm, cases, None if is_ref else [r["ids"] for r in refs], workers, answer_tokens)
    scores = [sc for _, sc in pairs]
    gens = [g for g, _ in pairs] if is_ref else None
    conts = [list(sc.token_ids) for sc in scores]
    per_case = []
    kls, agrees, kl_means = [], [], []
    recomputed = chunk_total = 0
    for i, (c, sc) in enumerate(zip(cases, scores)):
        chunk_tokens = sum(len(ids) for kind, ids in sc.prompt_segments if kind == "chunk")
        if is_ref:
            kl, ag = [0.0] * len(conts[i]), [True] * len(conts[i])
        else:
            kl, ag = kl_and_agreement(refs[i]["logits"], sc.logits)
        kls += kl
        agrees += ag
        km = kl_from_mean(refs[i]["mean_logp"], sc.logits) if not is_ref and "mean_logp" in refs[i] else []
        kl_means += km
        arg = sc.logits.argmax(-1).tolist()
        same = arg[:same_n] == conts[i][:same_n]
        margins = answer_margins(sc.logits)
        first_miss = next((j for j, (a, b) in enumerate(zip(arg, conts[i])) if a != b), len(conts[i]))
        rec = chunk_tokens - sc.usage.cached_chunk_tokens
        recomputed += rec
        chunk_total += chunk_tokens
        per_case.append(dict(id=c.id, setting=name, kl=sum(kl) / len(kl), top1=sum(ag) / len(ag), same_answer=same,
                             recomputed=rec, chunk_tokens=chunk_tokens, ids=conts[i], logits=sc.logits,
                             kl_mean=sum(km) / len(km) if km else None, margin=margins[0], margins=margins,
                             first_miss=first_miss))
        bar.update(1)
    # the setting's own greedy answers, for exact match against the references
    if generate_answers:
        if gens is None:
            gens = llm.generate_batch([dict(question=c.question, chunks=c.documents, system=c.system,
                                            max_new_tokens=answer_tokens) for c in cases])
        for pc, c, g in zip(per_case, cases, gens):
            pc["text"] = g.text
            pc["exact_match"] = exact_match(g.text, c.reference) if c.reference is not None else None
            pc["contains"] = contains_answer(g.text, c.reference) if c.reference is not None else None
    elif gens is not None:
        for pc, g in zip(per_case, gens):
            pc["text"] = g.text
    ttft = [_ttft(llm, c) for c in cases[:ttft_cases]]
    em = [pc["exact_match"] for pc in per_case if pc.get("exact_match") is not None]
    cont = [pc["contains"] for pc in per_case if pc.get("contains") is not None]
    n_same = sum(pc["same_answer"] for pc in per_case)
    row = dict(setting=name, kwargs=kwargs, cases=len(cases), tokens=len(kls), top1=sum(agrees) / len(agrees),
               kl=sum(kls) / len(kls), kl_max=max(kls), kl_mean=sum(kl_means) / len(kl_means) if kl_means else None,
               same_answer=n_same / len(cases), same_answer_n=n_same,
               exact_match=(sum(em) / len(em)) if em else None, contains=(sum(cont) / len(cont)) if cont else None,
               references=len(em),
               recomputed=recomputed / chunk_total if chunk_total else 0.0,
               recomputed_tokens_per_case=recomputed / len(cases),
               ttft_ms=statistics.median(ttft) * 1e3 if ttft else None,
               options={name: getattr(llm, name) for name in QUALITY_OPTIONS})
    return row, per_case


def _floor(hf, tok, backend, kv_cache_bytes, cases, refs, ref_row, ref_cases, *, orders, seed, same_n,
           bar) -> dict:
    """The order floor (``measure_floor``) on a full-attention engine over the same weights;
    full attention's own KL to the order-mean goes into its row and cases."""
    llm = LazyLLM(model=hf, tokenizer=tok, kv_cache_bytes=kv_cache_bytes, attention_backend=backend,
                  progress=False, **_FULL)
    try:
        floor = measure_floor(llm, cases, refs, orders, same_n=same_n, seed=seed, bar=bar)
    finally:
        llm.close()
    kms = []
    for pc, r in zip(ref_cases, refs):
        km = kl_from_mean(r["mean_logp"], r["logits"])
        pc["kl_mean"] = sum(km) / len(km)
        pc["floor"] = r["floor"]
        kms += km
    ref_row["kl_mean"] = sum(kms) / len(kms) if kms else None
    return floor


def _distinct(named: list[tuple[str, dict]]) -> tuple[list[tuple[str, dict]], dict[str, str]]:
    """The settings to run, one per distinct engine configuration (``"default"`` and
    ``"balanced"`` are one today), and each other name's twin among them."""
    from ..config import EngineConfig

    runs, twins, seen = [], {}, []
    for name, kw in named:
        cfg = EngineConfig.resolve(**kw).replace(quality=None)
        twin = next((n for n, c in seen if c == cfg), None)
        if twin is None:
            seen.append((name, cfg))
            runs.append((name, kw))
        else:
            twins[name] = twin
    return runs, twins


def _reference_answers(ref_row: dict, ref_cases: list[dict], cs: list[Case]) -> None:
    """Full attention's own answers against the cases' references (exact match, contains)."""
    for pc, c in zip(ref_cases, cs):
        pc["exact_match"] = exact_match(pc["text"], c.reference) if c.reference is not None else None
        pc["contains"] = contains_answer(pc["text"], c.reference) if c.reference is not None else None
    for key in ("exact_match", "contains"):
        vals = [pc[key] for pc in ref_cases if pc[key] is not None]
        ref_row[key] = sum(vals) / len(vals) if vals else None
    ref_row["references"] = sum(c.reference is not None for c in cs)


def _add_twins(rows: list[dict], per_case: list[dict], kwargs: dict[str, dict], twins: dict[str, str]) -> None:
    """Each setting that ``_distinct`` left out: its twin's row and cases under its own name."""
    for name, twin in twins.items():
        rows += [dict(r, setting=name, kwargs=kwargs[name]) for r in rows if r["setting"] == twin]
        per_case += [dict(pc, setting=name) for pc in per_case if pc["setting"] == twin]


def compare(llm_or_model: Any = None, cases: Any = None, settings: Any = None, target: Any = None, *,
            retriever: Any = None, system: str | None = None, answer_tokens: int = 16, same_answer_tokens: int = 8,
            ttft_cases: int = 8, workers: int = 4, progress: bool = True,
            kv_cache_bytes: int = 256 << 20, orders: int = 4, order_seed: int = 0) -> FidelityReport:
    """Run full attention and each candidate setting on ``cases`` and report their fidelity.

    Parameters
    ----------
    llm_or_model : a ``LazyLLM`` (its weights are shared by every setting, not copied), a
        model path / hub id, or ``None`` for the embedded default model.
    cases : a JSONL path, a list of ``Case`` / dicts, or (with ``retriever``) questions.
    settings : candidates: names (``"default"``: ``LazyLLM()``'s own; ``"fast"``,
        ``"balanced"``, ``"exact"``: the presets) or ``(name, LazyLLM kwargs)`` pairs or a
        ``{name: kwargs}`` dict. Default: ``DEFAULT_SETTINGS``. Settings that configure the
        engine alike (``"default"`` and ``"balanced"`` today) are run once and reported under
        each name.
    target : what ``recommend`` asks for: ``{"top1": 0.97, "kl": 0.01, "same_answer": 0.9}``
        (the default) or ``"top1>=0.97,kl<=0.01,same>=0.9"``.
    retriever : a LangChain or LlamaIndex retriever that supplies the documents.
    system : system prompt for cases that have none.
    answer_tokens : length (at most) of full attention's greedy answer that every setting is
        teacher-forced on, and of the answers compared with the references.
    same_answer_tokens : leading tokens that must agree for "same answer".
    ttft_cases : cases timed (one new token each) per setting.
    workers : score requests in flight at once (the engine batches them).
    progress : a tqdm progress bar over settings x cases.
    orders : distinct other orders of each case's documents under which full attention is
        measured (the order floor, ``lazyllm.quality.floor``); 0: no floor.
    order_seed : seed of the shuffled orders.
    """
    from tqdm.auto import tqdm

    tgt = parse_target(target)
    cs = as_cases(cases, retriever, system)
    named = _settings(settings)
    if isinstance(llm_or_model, LazyLLM):
        base = llm_or_model
        own = None
    else:
        base = own = LazyLLM(llm_or_model, reuse="none", kv_cache_bytes=kv_cache_bytes, progress=progress)
    hf, tok = base.hf_model, base.tokenizer
    backend = base.attention_backend
    gen_answers = any(c.reference is not None for c in cs)
    per_case: list[dict] = []
    rows = []
    runs, twins = _distinct(named)
    total = len(cs) * (len(runs) + 1 + (orders > 0))
    with tqdm(total=total, desc="fidelity", unit="case", disable=not progress) as bar:
        def run(name, kw, refs):
            bar.set_postfix_str(name)
            llm = LazyLLM(model=hf, tokenizer=tok, kv_cache_bytes=kv_cache_bytes, attention_backend=backend,
                          progress=False, **kw)
            try:
                llm.generate("Warm-up?", chunks=["A warm-up document."], max_new_tokens=1)
                return _measure(llm, name, kw, cs, refs, same_n=same_answer_tokens, ttft_cases=ttft_cases,
                                workers=workers, generate_answers=gen_answers and refs is not None,
                                answer_tokens=answer_tokens, bar=bar)
            finally:
                llm.close()

        ref_row, ref_cases = run(REFERENCE_NAME, dict(_FULL), None)
        if gen_answers:
            _reference_answers(ref_row, ref_cases, cs)
        refs = [dict(ids=pc["ids"], logits=pc["logits"], chunk_tokens=pc["chunk_tokens"]) for pc in ref_cases]
        floor = None
        if orders > 0:
            bar.set_postfix_str(FLOOR_NAME)
            floor = _floor(hf, tok, backend, kv_cache_bytes, cs, refs, ref_row, ref_cases, orders=orders,
                           seed=order_seed, same_n=same_answer_tokens, bar=bar)
        rows.append(ref_row)
        per_case += ref_cases
        for name, kw in runs:
            row, pcs = run(name, kw, refs)
            rows.append(row)
            per_case += pcs
        _add_twins(rows, per_case, dict(named), twins)
    if own is not None:
        own.close()
    for r in rows:
        r["meets_target"] = all(check_target(r, tgt).values())
    for pc in per_case:
        pc.pop("logits", None)
    model = str(getattr(hf.config, "_name_or_path", "") or type(hf).__name__)
    return FidelityReport(rows=rows, target=tgt, model=os.path.basename(model.rstrip("/")) or model,
                          n_cases=len(cs), answer_tokens=answer_tokens, same_answer_tokens=same_answer_tokens,
                          cases=per_case, floor=floor)


