"""``lazyllm adapt``: train a chunk packet on your own documents, no labels needed.

    from lazyllm.quality import adapt
    result = adapt(None, "docs/", out="my.packets.safetensors")   # a folder, a JSONL, a list...
    result.report                      # fidelity before / after on held-out documents
    llm = LazyLLM(packets="my.packets.safetensors")

Documents are split by document into training and held-out sets. Each training case is a
question about one document shown among others; questions come from templates (a sentence of
the document with a word blanked out, what the documents say about its subject) or are written
by the model itself. The model with full attention answers them (the teacher) and the packet
is trained so that isolated chunks give the same next-token distributions
(``lazyllm.quality.packet_training``). At the end ``compare`` reports fidelity to full
attention without and with the packet on cases over the held-out documents only.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..api import LazyLLM
from ..errors import InvalidRequestError
from .cases import cases_from_retriever, document_text
from .checks import check_recipe
from .packet_training import build_cases, mean_loss, train_packets

__all__ = ["adapt", "AdaptResult", "fit_documents", "load_documents", "make_items", "split_documents"]

log = logging.getLogger("lazyllm")

_TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
_SYSTEMS = ("Answer the question in a few words, using only the documents.", "You are a helpful assistant.", None)


def load_documents(source: Any) -> list[str]:
    """Document texts from a JSONL file (a line: a string, or an object with ``text`` /
    ``page_content`` / ``content``, or a case with ``documents``), a folder of text files
    (``.txt``, ``.md``, ``.rst``; one document each, searched recursively), a single text file,
    or a list of strings, LangChain ``Document``s, LlamaIndex nodes or dicts. Duplicates are
    dropped, order kept.

    A file that is not UTF-8 text (a NUL byte, or bytes UTF-8 cannot decode) is skipped with a
    warning naming it when it sits in a folder, and is an ``InvalidRequestError`` naming it when
    it was named itself; a document with a NUL character is an error naming where it came from."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            raw, skipped = [], []
            for p in sorted(path.rglob("*")):
                if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES:
                    try:
                        raw.append((str(p), _text_file(p)))
                    except InvalidRequestError:
                        skipped.append(str(p))
            if skipped:
                log.warning("lazyllm adapt: skipped %d file(s) that are not UTF-8 text: %s", len(skipped),
                            ", ".join(skipped))
        elif path.is_file() and path.suffix.lower() == ".jsonl":
            raw = []
            for n, line in enumerate(_text_file(path).splitlines(), 1):
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InvalidRequestError(f"{path}:{n}: not JSON: {e}") from None
                docs = obj.get("documents", []) if isinstance(obj, dict) and "documents" in obj else [obj]
                raw += [(f"{path}:{n}", d) for d in docs]
        elif path.is_file():
            raw = [(str(path), _text_file(path))]
        else:
            raise InvalidRequestError(f"no such file or folder: {str(path)!r}")
    elif isinstance(source, Sequence):
        raw = [(f"documents[{i}]", d) for i, d in enumerate(source)]
    else:
        raise InvalidRequestError(f"documents must be a path or a list, got {type(source).__name__}")
    out: list[str] = []
    for where, d in raw:
        try:
            t = document_text(d)
        except TypeError as e:
            raise InvalidRequestError(f"{where}: {e}") from None
        t = (t.text if hasattr(t, "text") else t).strip()
        if "\x00" in t:
            raise InvalidRequestError(f"{where}: the document contains a NUL character")
        if t and t not in out:
            out.append(t)
    return out


def _text_file(p: Path) -> str:
    """The text of ``p``, or an ``InvalidRequestError`` naming it where it is not UTF-8 text."""
    data = p.read_bytes()
    if b"\x00" in data:
        raise InvalidRequestError(f"{p}: a binary file (it contains NUL bytes), not a text document")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"{p}: not UTF-8 text (an invalid byte at offset {e.start})") from None


def fit_documents(docs: Sequence[str], count_tokens, budget: int) -> list[str]:
    """``docs`` with each document longer than ``budget`` tokens (``count_tokens(text)``) split
    into consecutive pieces that fit, at paragraph breaks, else at line ends, else
    between words (as a retriever's splitter would): a training case shows several documents in
    the model's context, so one long file must not overflow it."""
    out: list[str] = []
    for d in docs:
        out += _split_to_fit(d, count_tokens, budget, ("\n\n", "\n", " "))
    return out


def _split_to_fit(text: str, count_tokens, budget: int, seps: Sequence[str]) -> list[str]:
    if count_tokens(text) <= budget:
        return [text]
    if not seps:  # one word longer than the budget: cut it by characters
        half = len(text) // 2
        return _split_to_fit(text[:half], count_tokens, budget, ()) + _split_to_fit(text[half:], count_tokens,
                                                                                    budget, ())
    # parts packed greedily, their token counts added (each part tokenized once, so a long file
    # costs linear time; a join may differ from the sum by a token or so, within the case's margin)
    sep, pieces, cur, n = seps[0], [], "", 0
    for part in text.split(sep):
        k = count_tokens(sep + part)
        if cur and n + k > budget:
            pieces.append(cur)
            cur, n = "", 0
        cur, n = (cur + sep + part if cur else part), n + k
    pieces.append(cur)
    return [q.strip() for p in pieces for q in _split_to_fit(p, count_tokens, budget, seps[1:]) if q.strip()]


def split_documents(docs: Sequence[str], heldout: float, seed: int = 0) -> tuple[list[str], list[str]]:
    """``(training, held-out)`` documents: a random ``heldout`` fraction (at least one) held out."""
    if not 0.0 < heldout < 1.0:
        raise InvalidRequestError(f"heldout must be in (0, 1), got {heldout!r}")
    order = list(docs)
    random.Random(seed).shuffle(order)
    n = max(1, round(len(order) * heldout))
    return order[n:], order[:n]


def _template_question(doc: str, rng: random.Random) -> str:
    sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", doc) if 20 <= len(s.strip()) <= 240]
    if sents and rng.random() < 0.6:
        s = rng.choice(sents)
        words = re.findall(r"\b(?:\d[\d,.]*|[A-Za-z]{6,})\b", s)
        if words:
            w = rng.choice(words)
            return f'Which word or number fills the blank in this sentence from the documents: ' \
                   f'"{s.replace(w, "____", 1)}"'
    subject = " ".join(doc.split()[:rng.randint(3, 6)]).rstrip(".,;:")
    return rng.choice([f'What do the documents say about "{subject}"?',
                       f'Summarize the document that begins "{subject}" in one sentence.'])


def _model_questions(llm: LazyLLM, docs: Sequence[str]) -> list[str | None]:
    """One question per document written by the model itself (``None`` where it wrote none)."""
    gens = llm.generate_batch([dict(question=f"Write one short question that this text answers.\n\nText: {d[:1500]}",
                                    chunks=[], system="You write quiz questions.", max_new_tokens=32)
                               for d in docs])
    out: list[str | None] = []
    for g in gens:
        q = g.text.strip().split("\n")[0]
        out.append(q[:q.index("?") + 1].strip() if "?" in q and len(q) > 8 else None)
    return out


def make_items(llm: LazyLLM, docs: Sequence[str], n: int, *, docs_per_case: int = 4, questions: str = "templates",
               system: str | None = None, seed: int = 0) -> list[dict]:
    """``n`` cases ``{"question", "documents", "system"}`` over ``docs``: each about one document
    (cycling through them) shown with ``docs_per_case - 1`` others in a random order.
    ``questions``: ``"templates"``, ``"model"`` (written by ``llm``) or ``"mixed"``."""
    if questions not in ("templates", "model", "mixed"):
        raise InvalidRequestError(f"questions must be 'templates', 'model' or 'mixed', got {questions!r}")
    if not docs:
        raise InvalidRequestError("no documents")
    rng = random.Random(seed)
    about = [docs[i % len(docs)] for i in range(n)]
    asked: list[str | None] = [None] * n
    if questions != "templates":
        want = [i for i in range(n) if questions == "model" or i % 2]
        for i, q in zip(want, _model_questions(llm, [about[i] for i in want])):
            asked[i] = q
    items = []
    k = min(docs_per_case, len(docs))
    for i, d in enumerate(about):
        others = rng.sample([x for x in docs if x is not d], k - 1)
        chunks = others + [d]
        rng.shuffle(chunks)
        q = asked[i] or _template_question(d, rng)
        items.append(dict(question=q, documents=chunks, system=system if system is not None else rng.choice(_SYSTEMS)))
    return items


@dataclass
class AdaptResult:
    """What ``adapt`` made: the packet (also written to ``path``), the fidelity ``report``
    (``FidelityReport``: full attention, no packet, the packet) on held-out documents, the
    distillation loss on the held-out cases before and after, and the split."""

    packets: Any
    path: str
    report: Any = None
    heldout_loss_before: float | None = None
    heldout_loss_after: float | None = None
    split: dict = field(default_factory=dict)
    log: dict = field(default_factory=dict)

    def _repr_markdown_(self) -> str:
        head = (f"Packet `{self.path}` ({self.packets.k_header} header + {self.packets.k_trailer} trailer tokens), "
                f"trained on {self.split.get('train_documents')} documents ({self.split.get('train_cases')} cases); "
                f"held out: {self.split.get('heldout_documents')} documents ({self.split.get('heldout_cases')} cases)."
                f" Held-out distillation loss {self.heldout_loss_before:.4f} -> {self.heldout_loss_after:.4f}.\n\n")
        return head + (self.report.to_markdown() if self.report is not None else "")


def _teacher_llm(llm_or_model: Any) -> LazyLLM:
    """A full-attention ``LazyLLM`` over the given model (a ``LazyLLM``'s weights are shared)."""
    kw = dict(reuse="none", packets=None, kv_cache_bytes=256 << 20, progress=False)
    if isinstance(llm_or_model, LazyLLM):
        return LazyLLM(model=llm_or_model.hf_model, tokenizer=llm_or_model.tokenizer,
                       attention_backend=llm_or_model.attention_backend, **kw)
    return LazyLLM(llm_or_model, **kw)


def adapt(llm_or_model: Any = None, documents: Any = None, *, out: str | os.PathLike = "packets.safetensors",
          questions: Sequence[str] | str = "templates", retriever: Any = None, k_header: int = 8, k_trailer: int = 8,
          cases: int = 80, heldout: float = 0.2, heldout_cases: int = 16, docs_per_case: int = 4,
          steps: int = 120, minutes: float | None = 15.0, lr: float = 1e-2, system: str | None = None,
          report: bool = True, progress: bool = True, seed: int = 0) -> AdaptResult:
    """Train a packet for a model on your documents and report its fidelity.

    Parameters
    ----------
    llm_or_model : a ``LazyLLM`` (its weights are used, not copied), a model path / hub id, or
        ``None`` for the embedded default model.
    documents : see ``load_documents``; or, with ``retriever``, ignored.
    questions : ``"templates"``, ``"model"`` (the model writes a question per document) or
        ``"mixed"``; with ``retriever``, your own questions (a list of strings): each one's
        retrieved documents make a case.
    retriever : a LangChain or LlamaIndex retriever that supplies the documents for ``questions``.
    k_header, k_trailer : packet embeddings before and after every chunk.
    cases, heldout_cases : training cases and held-out cases made from the documents.
    heldout : fraction of the documents held out (never trained on) for the report.
    steps, minutes, lr : Adam steps (one case each), a time limit, the learning rate. The
        defaults are the cheapest recipe that matched the longest one measured on held-out cases
        (BENCHMARKS.md, "Learned chunk packets"): 8 + 8 tokens, 80 cases, 120 steps.
    report : run ``compare`` (full attention, no packet, the packet) on the held-out cases.
    """
    from .report import compare

    check_recipe(k_header=k_header, k_trailer=k_trailer, cases=cases, heldout=heldout, heldout_cases=heldout_cases,
                 docs_per_case=docs_per_case, steps=steps, minutes=minutes, lr=lr, out=out)
    full = _teacher_llm(llm_or_model)
    hf, tok = full.hf_model, full.tokenizer
    try:
        if retriever is not None:
            if isinstance(questions, str):
                raise InvalidRequestError("with a retriever, questions must be your list of questions")
            all_items = [dict(question=c.question, documents=[document_text(d) for d in c.documents],
                              system=system) for c in cases_from_retriever(retriever, list(questions), system=system)]
            docs = load_documents([d for it in all_items for d in it["documents"]])
            train_docs, held_docs = split_documents(docs, heldout, seed)
            held_set = set(held_docs)
            train_items = [it for it in all_items if not held_set & set(it["documents"])]
            held_items = [it for it in all_items if set(it["documents"]) <= held_set]
        else:
            if not isinstance(questions, str):
                raise InvalidRequestError("questions must be 'templates', 'model' or 'mixed' without a retriever")
            # room for a case's question, system prompt, template and answer beside its documents
            per_doc = max(64, (full.inputs.max_context - 512) // docs_per_case)
            docs = fit_documents(load_documents(documents), full.count_tokens, per_doc)
            if len(docs) < 4:
                raise InvalidRequestError(f"{len(docs)} distinct documents; adapt needs at least 4")
            train_docs, held_docs = split_documents(docs, heldout, seed)
            train_items = make_items(full, train_docs, cases, docs_per_case=docs_per_case, questions=questions,
                                     system=system, seed=seed)
            held_items = make_items(full, held_docs, heldout_cases, docs_per_case=docs_per_case,
                                    questions=questions, system=system, seed=seed + 1)
        if not train_items:
            raise InvalidRequestError("no training cases (every case touches a held-out document)")
        train = build_cases(full, train_items, progress=progress)
        held = build_cases(full, held_items, progress=progress) if held_items else []
        cpu_bf16 = hf.device.type == "cpu" and "AVX512" in torch.backends.cpu.get_cpu_capability()
        packets, log = train_packets(hf, tok, train, k_header=k_header, k_trailer=k_trailer, steps=steps, lr=lr,
                                     seed=seed, time_limit_s=None if minutes is None else minutes * 60,
                                     autocast=torch.bfloat16 if cpu_bf16 else None, progress=progress)
        packets.info.update(train_documents=len(train_docs), train_cases=len(train), questions=str(questions)[:40])
        path = str(packets.save(out))
        res = AdaptResult(packets, path, split=dict(train_documents=len(train_docs), heldout_documents=len(held_docs),
                                                    train_cases=len(train), heldout_cases=len(held)), log=log)
        if held:
            res.heldout_loss_before = mean_loss(hf, held, None)
            res.heldout_loss_after = mean_loss(hf, held, packets.rows, packets.k_header)
        if report and held_items:
            iso = {"quality": "isolated"}  # the layout a packet is trained for
            res.report = compare(full, held_items, settings=[("no packet", {**iso, "packets": None}),
                                                             ("packet", {**iso, "packets": path})], progress=progress)
        return res
    finally:
        full.close()
