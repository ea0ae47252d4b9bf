"""Fidelity report: how far each reuse setting's answers are from full attention's, on your
own questions and documents.

A chunk encoded alone never saw the other documents, so a request over cached chunk KV can
answer differently from the same model with full attention. ``compare`` measures by how
much, for each candidate setting, on the cases you give it::

    from lazyllm import LazyLLM
    from lazyllm.quality import compare

    report = compare(LazyLLM(), "cases.jsonl", target="top1>=0.97,kl<=0.01,same>=0.9")
    report.to_markdown(); report.plot(); report.recommend()

or from a shell: ``python -m lazyllm.quality cases.jsonl --target top1=0.97,kl=0.01``.

A case is a question, its retrieved documents, an optional system prompt and an optional
reference answer: a JSONL line ``{"question": ..., "documents": [...], "system": ...,
"reference": ...}``, a ``Case``, a dict, or questions plus a LangChain retriever
(``retriever.invoke(question)``) or LlamaIndex retriever / nodes (``NodeWithScore``,
``TextNode``) as the source of documents.

Per setting (and for full attention, the reference):

* ``top1``: fraction of answer positions where the setting's most likely token is full
  attention's, teacher-forced on full attention's greedy answer (``LazyLLM.score``);
* ``kl``: mean KL(full || setting) over those positions, nats per token;
* ``same_answer``: fraction of cases whose greedy answer starts with the same
  ``same_answer_tokens`` tokens as full attention's (read off the teacher-forced argmax:
  both see the same context up to the first difference);
* ``exact_match``: fraction of cases whose own greedy answer (or its first sentence) equals
  the reference answer (normalized: case, punctuation, articles, whitespace), and
  ``contains``: fraction whose answer contains the reference, when references are given;
* ``recomputed``: chunk tokens computed for the request over all chunk tokens, with every
  document cached beforehand (1.0 for full attention);
* ``ttft_ms``: median time to first token over the cases (warm chunk cache).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import string
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .api import LazyLLM
from .quality_presets import PRESETS
from .types import Chunk

__all__ = ["Case", "FidelityReport", "compare", "load_cases", "cases_from_retriever", "document_text",
           "kl_and_agreement", "parse_target", "DEFAULT_TARGET", "DEFAULT_SETTINGS", "main"]

# what a setting must reach to be recommended when the caller names no target
DEFAULT_TARGET: dict[str, float] = {"top1": 0.97, "kl": 0.01, "same_answer": 0.9}
# the candidates compared when the caller names none: today's default and the presets
DEFAULT_SETTINGS: tuple[str, ...] = ("default", "fast", "balanced", "exact")
REFERENCE_NAME = "full attention"
_FULL = {"reuse": "none"}
# metrics a target may name; True: higher is better
_METRICS = {"top1": True, "kl": False, "same_answer": True, "exact_match": True, "contains": True,
            "recomputed": False,
            "ttft_ms": False}
_ALIASES = {"same": "same_answer", "em": "exact_match", "exact": "exact_match", "top-1": "top1",
            "agreement": "top1", "recompute": "recomputed", "ttft": "ttft_ms"}


# -- cases ---------------------------------------------------------------------------------
@dataclass
class Case:
    """One question with its retrieved documents (``str`` or ``Chunk``)."""

    question: str
    documents: list[str | Chunk]
    system: str | None = None
    reference: str | None = None
    id: str | None = None


def document_text(doc: Any) -> str | Chunk:
    """A retrieved document as a chunk: a ``str`` or ``Chunk`` as is, a LangChain
    ``Document`` (``page_content``), a LlamaIndex ``NodeWithScore`` or ``TextNode``
    (``get_content()``), or a dict with ``text`` / ``page_content``."""
    if isinstance(doc, (str, Chunk)):
        return doc
    if isinstance(doc, Mapping):
        for key in ("text", "page_content", "content"):
            if isinstance(doc.get(key), str):
                return doc[key]
        raise TypeError(f"a document dict needs a 'text' field, got keys {sorted(doc)}")
    if isinstance(getattr(doc, "page_content", None), str):  # LangChain Document
        return doc.page_content
    node = getattr(doc, "node", None)  # LlamaIndex NodeWithScore
    if node is not None:
        doc = node
    get = getattr(doc, "get_content", None)  # LlamaIndex TextNode / Node
    if callable(get):
        return get()
    if isinstance(getattr(doc, "text", None), str):
        return doc.text
    raise TypeError(f"cannot read a document's text from a {type(doc).__name__}")


def _case(obj: Any, i: int) -> Case:
    if isinstance(obj, Case):
        return Case(obj.question, [document_text(d) for d in obj.documents], obj.system, obj.reference,
                    obj.id if obj.id is not None else str(i))
    if not isinstance(obj, Mapping):
        raise TypeError(f"case {i}: expected a Case or a dict, got {type(obj).__name__}")
    q = obj.get("question")
    if not isinstance(q, str) or not q:
        raise ValueError(f"case {i}: needs a non-empty 'question'")
    docs = next((obj[k] for k in ("documents", "chunks", "contexts", "nodes") if k in obj), None)
    if not isinstance(docs, Sequence) or isinstance(docs, str):
        raise ValueError(f"case {i}: needs 'documents', a list")
    ref = next((obj[k] for k in ("reference", "answer", "reference_answer") if obj.get(k) is not None), None)
    return Case(q, [document_text(d) for d in docs], obj.get("system"), ref, str(obj.get("id", i)))


def load_cases(path: str | os.PathLike) -> list[Case]:
    """Cases from a JSONL file: one JSON object a line with ``question``, ``documents`` (a
    list of strings or ``{"text": ...}``), and optional ``system``, ``reference`` and ``id``.
    Blank lines and lines starting with ``#`` are skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            out.append(_case(obj, len(out)))
    return out


def cases_from_retriever(retriever: Any, questions: Sequence[str], *, references: Sequence[str | None] | None = None,
                         system: str | None = None) -> list[Case]:
    """Cases whose documents come from a retriever: a LangChain retriever
    (``retriever.invoke(question)`` returns ``Document``s) or a LlamaIndex retriever
    (``retriever.retrieve(question)`` returns ``NodeWithScore``s)."""
    if references is not None and len(references) != len(questions):
        raise ValueError("references must have one entry per question")
    out = []
    for i, q in enumerate(questions):
        if hasattr(retriever, "invoke"):
            docs = retriever.invoke(q)
        elif hasattr(retriever, "retrieve"):
            docs = retriever.retrieve(q)
        else:
            raise TypeError("retriever must have .invoke (LangChain) or .retrieve (LlamaIndex)")
        out.append(Case(q, [document_text(d) for d in docs], system,
                        None if references is None else references[i], str(i)))
    return out


def _as_cases(cases: Any, retriever: Any, system: str | None) -> list[Case]:
    if isinstance(cases, (str, os.PathLike)):
        out = load_cases(cases)
    elif retriever is not None:
        qs = list(cases)
        if qs and all(isinstance(q, str) for q in qs):
            out = cases_from_retriever(retriever, qs, system=system)
        else:  # dicts / Cases without documents: fill them from the retriever
            out = []
            for i, c in enumerate(qs):
                c = dict(asdict(c)) if isinstance(c, Case) else dict(c)
                if not c.get("documents"):
                    c["documents"] = cases_from_retriever(retriever, [c["question"]])[0].documents
                out.append(_case(c, i))
    else:
        out = [_case(c, i) for i, c in enumerate(cases)]
    if system is not None:
        for c in out:
            c.system = c.system if c.system is not None else system
    if not out:
        raise ValueError("no cases")
    return out


# -- metrics -------------------------------------------------------------------------------
def kl_and_agreement(ref_logits: torch.Tensor, logits: torch.Tensor) -> tuple[list[float], list[bool]]:
    """Per position: KL(softmax(ref) || softmax(logits)) in nats (float64), and whether the
    two argmaxes agree. Both ``(positions, vocab)``."""
    lp = torch.log_softmax(ref_logits.double(), dim=-1)
    lq = torch.log_softmax(logits.double(), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)  # >= 0 up to float64 rounding
    agree = ref_logits.argmax(-1) == logits.argmax(-1)
    return kl.tolist(), agree.tolist()


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
    (em), recomputed, ttft_ms."""
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
        if k not in _METRICS:
            raise ValueError(f"unknown target metric {k!r}; one of {sorted(_METRICS)}")
        out[k] = float(v)
    return out


def _meets(row: dict, target: dict[str, float]) -> dict[str, bool]:
    out = {}
    for k, v in target.items():
        x = row.get(k)
        out[k] = x is not None and ((x >= v) if _METRICS[k] else (x <= v))
    return out


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

    def recommend(self, target: str | Mapping[str, float] | None = None) -> str:
        """The cheapest setting (fewest chunk tokens recomputed, then lowest TTFT) that meets
        ``target`` (default: the report's); full attention when none does."""
        t = self.target if target is None else parse_target(target)
        ok = [r for r in self.rows if all(_meets(r, t).values())]
        if not ok:
            return REFERENCE_NAME
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
            lines.append(f"| {r['setting']} | {pct(r['top1'])} | {r['kl']:.4f} | {same} | "
                         f"{pct(r['exact_match'])} | {pct(r.get('contains'))} | {pct(r['recomputed'])} | {ttft} "
                         f"| {meets} |")
        tgt = ", ".join(f"{k} {'>=' if _METRICS[k] else '<='} {v:g}" for k, v in t.items())
        rec = self.recommend()
        return "\n".join(lines) + (
            f"\n\n{self.n_cases} cases, {self.model}; teacher-forced on full attention's greedy answer "
            f"({self.answer_tokens} tokens at most); same answer: first {self.same_answer_tokens} tokens. "
            f"Target: {tgt}. Recommended: **{rec}**"
            + (" (no reusable setting meets the target)" if rec == REFERENCE_NAME else "") + ".")

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def plot(self, ax=None, path: str | os.PathLike | None = None):
        """Top-1 agreement and same-answer rate against recomputed chunk tokens, one point
        per setting, the target's lines dashed. Returns the matplotlib figure."""
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
def _settings(settings: Any) -> list[tuple[str, dict]]:
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
        out.append((name, dict(kw)))
    return out


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
    ttft = [llm.generate(c.question, chunks=c.documents, system=c.system, max_new_tokens=1).ttft_s
            for c in cases[:ttft_cases]]
    em = [pc["exact_match"] for pc in per_case if pc.get("exact_match") is not None]
    cont = [pc["contains"] for pc in per_case if pc.get("contains") is not None]
    n_same = sum(pc["same_answer"] for pc in per_case)
    row = dict(setting=name, kwargs=kwargs, cases=len(cases), tokens=len(kls), top1=sum(agrees) / len(agrees),
               kl=sum(kls) / len(kls), kl_max=max(kls), same_answer=n_same / len(cases), same_answer_n=n_same,
               exact_match=(sum(em) / len(em)) if em else None, contains=(sum(cont) / len(cont)) if cont else None,
               recomputed=recomputed / chunk_total if chunk_total else 0.0,
               recomputed_tokens_per_case=recomputed / len(cases),
               ttft_ms=statistics.median(ttft) * 1e3 if ttft else None,
               options=dict(reuse=llm.reuse, chunk_context=llm.chunk_context,
                            recompute_first_tokens=llm.recompute_first_tokens, recompute_ratio=llm.recompute_ratio,
                            recompute_selection=llm.recompute_selection, context_temperature=llm.context_temperature,
                            context_lse_scale=llm.context_lse_scale))
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


# -- CLI -----------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> FidelityReport:
    ap = argparse.ArgumentParser(prog="python -m lazyllm.quality",
                                 description="Fidelity of lazyllm's reuse settings to full attention on your cases.")
    ap.add_argument("cases", help="JSONL: question, documents, optional system and reference")
    ap.add_argument("--model", default=None, help="model folder / .gguf / hub id (default: the embedded model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                    help=f"comma-separated: 'default' and presets {tuple(PRESETS)}, or name=JSON kwargs "
                         "separated by ';' (e.g. 'r30={\"quality\":\"balanced\",\"recompute_ratio\":0.3}')")
    ap.add_argument("--target", default=None, help="e.g. top1>=0.97,kl<=0.01,same>=0.9 (the default)")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--same-answer-tokens", type=int, default=8)
    ap.add_argument("--ttft-cases", type=int, default=8)
    ap.add_argument("--system", default=None, help="system prompt for cases without one")
    ap.add_argument("--markdown", default=None, help="write the table here")
    ap.add_argument("--json", default=None, help="write the full report here")
    ap.add_argument("--plot", default=None, help="write the plot here (PNG)")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    if "{" in a.settings:
        settings = []
        for part in filter(None, (p.strip() for p in a.settings.split(";"))):
            name, _, kw = part.partition("=")
            settings.append((name.strip(), json.loads(kw)) if kw else (name.strip(), None))
    else:
        settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    t0 = time.perf_counter()
    llm = LazyLLM(a.model, device=a.device, reuse="none", kv_cache_bytes=256 << 20, progress=not a.no_progress)
    try:
        report = compare(llm, a.cases, settings, a.target, system=a.system, answer_tokens=a.answer_tokens,
                         same_answer_tokens=a.same_answer_tokens, ttft_cases=a.ttft_cases,
                         progress=not a.no_progress)
    finally:
        llm.close()
    md = report.to_markdown()
    print(md)
    print(f"\n({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(md + "\n")
    if a.json:
        report.to_json(a.json)
    if a.plot:
        report.plot(path=a.plot)
    return report


if __name__ == "__main__":
    main()
