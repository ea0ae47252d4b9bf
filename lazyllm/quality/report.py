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
from .cases import Case, _as_cases
from .checks import check_settings as _settings
from .metrics import _METRICS, _meets, contains_answer, exact_match, kl_and_agreement, parse_target

# the candidates compared when the caller names none: the default and the presets
REFERENCE_NAME = "full attention"
# what recommend() answers when no setting meets the target: full attention's answers, as a
# preset LazyLLM(quality=...) takes
FALLBACK = "exact"
_FULL = {"reuse": "none"}


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
        ok = [r for r in self.rows if r["setting"] != REFERENCE_NAME and all(_meets(r, t).values())]
        if not ok:
            return FALLBACK
        ok.sort(key=lambda r: (r["recomputed"], r["ttft_ms"] if r["ttft_ms"] is not None else math.inf))
        return ok[0]["setting"]

    def to_dict(self) -> dict:
        return dict(model=self.model, n_cases=self.n_cases, answer_tokens=self.answer_tokens,
                    same_answer_tokens=self.same_answer_tokens, target=self.target,
                    recommendation=self.recommend(), rows=self.rows, cases=self.cases)

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
                k for k, v in _meets(r, t).items() if not v) + ")"
            n_ref = r.get("references") or 0
            em = "-" if not n_ref else f"{pct(r['exact_match'])} ({round(r['exact_match'] * n_ref)}/{n_ref})"
            cont = "-" if not n_ref else f"{pct(r.get('contains'))} ({round(r['contains'] * n_ref)}/{n_ref})"
            lines.append(f"| {r['setting']} | {pct(r['top1'])} | {r['kl']:.4f} | {same} | "
                         f"{em} | {cont} | {pct(r['recomputed'])} | {ttft} | {meets} |")
        tgt = ", ".join(f"{k} {'>=' if _METRICS[k] else '<='} {v:g}" for k, v in t.items())
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
def _score(llm: LazyLLM, cases: list[Case], conts: list[list[int]], workers: int):
    def one(i):
        c = cases[i]
        return llm.score(c.question, chunks=c.documents, system=c.system, continuation=conts[i], return_logits=True)

    if workers <= 1:
        return [one(i) for i in range(len(cases))]
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, range(len(cases))))


def _warm(llm: LazyLLM, cases: list[Case]) -> None:
    """Cache every document on its own (each system prompt's), so that the cases then reuse
    them at other positions and next to other documents, as in serving."""
    if not llm.engine.planner.caches_chunks:
        return
    by_system: dict[str | None, list] = {}
    for c in cases:
        seen = by_system.setdefault(c.system, [])
        for d in c.documents:
            if d not in seen:
                seen.append(d)
    for system, docs in by_system.items():
        llm.warm(list(reversed(docs)), system=system, progress=False)


def _ttft(llm: LazyLLM, c: Case) -> float:
    """TTFT of one case as a new request sees it: its documents cached where the setting
    caches chunks (``_warm``), the prompt computed afresh where it reuses only an identical
    prefix (the scoring passes just computed this very prompt, which a new question would not
    find)."""
    if not llm.engine.planner.caches_chunks:
        llm.clear_cache()
    return llm.generate(c.question, chunks=c.documents, system=c.system, max_new_tokens=1).ttft_s


def _measure(llm: LazyLLM, name: str, kwargs: dict, cases: list[Case], refs: list[dict], *, same_n: int,
             ttft_cases: int, workers: int, generate_answers: bool, answer_tokens: int, bar) -> tuple[dict, list]:
    is_ref = refs is None
    _warm(llm, cases)
    if is_ref:
        gens = llm.generate_batch([dict(question=c.question, chunks=c.documents, system=c.system,
                                        max_new_tokens=answer_tokens) for c in cases])
        conts = [list(g.token_ids) or [llm.tokenizer.eos_token_id] for g in gens]
    else:
        gens = None
        conts = [r["ids"] for r in refs]
    scores = _score(llm, cases, conts, workers)
    per_case = []
    kls, agrees = [], []
    recomputed = chunk_total = 0
    for i, (c, sc) in enumerate(zip(cases, scores)):
        chunk_tokens = sum(len(ids) for kind, ids in sc.prompt_segments if kind == "chunk")
        if is_ref:
            kl, ag = [0.0] * len(conts[i]), [True] * len(conts[i])
        else:
            kl, ag = kl_and_agreement(refs[i]["logits"], sc.logits)
        kls += kl
        agrees += ag
        arg = sc.logits.argmax(-1).tolist()
        same = arg[:same_n] == conts[i][:same_n]
        rec = chunk_tokens - sc.usage.cached_chunk_tokens
        recomputed += rec
        chunk_total += chunk_tokens
        per_case.append(dict(id=c.id, setting=name, kl=sum(kl) / len(kl), top1=sum(ag) / len(ag), same_answer=same,
                             recomputed=rec, chunk_tokens=chunk_tokens, ids=conts[i], logits=sc.logits))
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
               kl=sum(kls) / len(kls), kl_max=max(kls), same_answer=n_same / len(cases), same_answer_n=n_same,
               exact_match=(sum(em) / len(em)) if em else None, contains=(sum(cont) / len(cont)) if cont else None,
               references=len(em),
               recomputed=recomputed / chunk_total if chunk_total else 0.0,
               recomputed_tokens_per_case=recomputed / len(cases),
               ttft_ms=statistics.median(ttft) * 1e3 if ttft else None,
               options={name: getattr(llm, name) for name in QUALITY_OPTIONS})
    return row, per_case


def compare(llm_or_model: Any = None, cases: Any = None, settings: Any = None, target: Any = None, *,
            retriever: Any = None, system: str | None = None, answer_tokens: int = 16, same_answer_tokens: int = 8,
            ttft_cases: int = 8, workers: int = 4, progress: bool = True,
            kv_cache_bytes: int = 256 << 20) -> FidelityReport:
    """Run full attention and each candidate setting on ``cases`` and report their fidelity.

    Parameters
    ----------
    llm_or_model : a ``LazyLLM`` (its weights are shared by every setting, not copied), a
        model path / hub id, or ``None`` for the embedded default model.
    cases : a JSONL path, a list of ``Case`` / dicts, or (with ``retriever``) questions.
    settings : candidates: names (``"default"``: ``LazyLLM()``'s own; ``"fast"``,
        ``"balanced"``, ``"exact"``: the presets) or ``(name, LazyLLM kwargs)`` pairs or a
        ``{name: kwargs}`` dict. Default: ``DEFAULT_SETTINGS``.
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
    """
    from tqdm.auto import tqdm

    tgt = parse_target(target)
    cs = _as_cases(cases, retriever, system)
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
    with tqdm(total=len(cs) * (len(named) + 1), desc="fidelity", unit="case", disable=not progress) as bar:
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
            for pc, c in zip(ref_cases, cs):
                pc["exact_match"] = exact_match(pc["text"], c.reference) if c.reference is not None else None
                pc["contains"] = contains_answer(pc["text"], c.reference) if c.reference is not None else None
            for key in ("exact_match", "contains"):
                vals = [pc[key] for pc in ref_cases if pc[key] is not None]
                ref_row[key] = sum(vals) / len(vals) if vals else None
            ref_row["references"] = sum(c.reference is not None for c in cs)
        refs = [dict(ids=pc["ids"], logits=pc["logits"], chunk_tokens=pc["chunk_tokens"]) for pc in ref_cases]
        rows.append(ref_row)
        per_case += ref_cases
        for name, kw in named:
            row, pcs = run(name, kw, refs)
            rows.append(row)
            per_case += pcs
    if own is not None:
        own.close()
    for r in rows:
        r["meets_target"] = all(_meets(r, tgt).values())
    for pc in per_case:
        pc.pop("logits", None)
    model = str(getattr(hf.config, "_name_or_path", "") or type(hf).__name__)
    return FidelityReport(rows=rows, target=tgt, model=os.path.basename(model.rstrip("/")) or model,
                          n_cases=len(cs), answer_tokens=answer_tokens, same_answer_tokens=same_answer_tokens,
                          cases=per_case)


