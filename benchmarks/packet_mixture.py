"""A varied training mixture for packets, from text that installs offline: paragraphs of the
documentation, licences, READMEs and package descriptions that Debian and Python packages put
on the machine, beside the templated fictional entries of ``packet_corpus.py``. Questions
come from templates (a sentence with a word blanked out, what the documents say about a
subject) and, with ``model_questions``, from the model itself.

The examples' corpus (examples/corpus.py) and every evaluation case (tests/data/*.jsonl)
are never part of it: paragraphs that share a sentence with them are dropped.

    from benchmarks.packet_mixture import mixture_items
    items = mixture_items(llm, 80, seed=0)      # [{"question", "documents", "system"}]
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import random
import re
import site
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.packet_corpus import synthetic_cases  # noqa: E402

_SOURCES = ("/usr/share/doc/*/README*", "/usr/share/doc/*/NEWS*", "/usr/share/doc/*/*.txt",
            "/usr/share/common-licenses/*")


def _read(path: str) -> str:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                return f.read(200_000)
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(200_000)
    except (OSError, EOFError):
        return ""


def _metadata_texts() -> list[str]:
    """Long descriptions of the installed Python distributions (their README as PyPI shows it)."""
    out = []
    for d in site.getsitepackages():
        for path in sorted(glob.glob(os.path.join(d, "*.dist-info", "METADATA"))):
            text = _read(path)
            _, _, body = text.partition("\n\n")
            out.append(body)
    return out


def _prose(text: str, lo: int = 220, hi: int = 900) -> list[str]:
    """Paragraphs of ``text`` that read as prose: ``lo``-``hi`` characters, mostly letters, a few
    sentences, no code, tables or lists."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        p = " ".join(para.split())
        if not lo <= len(p) <= hi or p.count(". ") < 1:
            continue
        letters = sum(ch.isalpha() or ch == " " for ch in p) / len(p)
        if letters < 0.88 or re.search(r"[{}<>|$\\]|```|::|=>|\b(def|import|return)\b|^[-*#=+]", p):
            continue
        out.append(p)
    return out


def _excluded_sentences() -> set[str]:
    texts = []
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from corpus import DOCS  # the examples' corpus

    texts += list(DOCS.values())
    for path in glob.glob(os.path.join(ROOT, "tests/data/*.jsonl")):
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        for line in lines:
            if line.strip() and not line.startswith("#"):
                case = json.loads(line)
                texts += [case.get("question", "")] + [d if isinstance(d, str) else json.dumps(d)
                                                      for d in case.get("documents", [])]
    return {s.strip().lower() for t in texts for s in re.split(r"(?<=[.!?])\s+", t) if len(s.strip()) > 20}


def real_documents(limit: int = 4000, seed: int = 0) -> list[str]:
    """Up to ``limit`` prose paragraphs from the machine's installed documentation, shuffled
    with ``seed``; none shares a sentence with the examples' corpus or an evaluation case."""
    texts = _metadata_texts()
    for pattern in _SOURCES:
        texts += [_read(p) for p in sorted(glob.glob(pattern)) if os.path.isfile(p)]
    banned = _excluded_sentences()
    seen, docs = set(), []
    for t in texts:
        for p in _prose(t):
            key = p.lower()
            if key in seen or any(s.strip().lower() in banned for s in re.split(r"(?<=[.!?])\s+", p)):
                continue
            seen.add(key)
            docs.append(p)
    random.Random(seed).shuffle(docs)
    return docs[:limit]


def mixture_items(llm, n: int, *, real_fraction: float = 0.5, docs_per_case: int = 4, model_questions: bool = True,
                  seed: int = 0) -> list[dict]:
    """``n`` training cases: ``real_fraction`` of them over real paragraphs (questions from
    templates, and half written by ``llm`` when ``model_questions``), the rest from
    ``packet_corpus.synthetic_cases``."""
    from lazyllm.quality.adapt import make_items

    n_real = round(n * real_fraction)
    docs = real_documents(seed=seed)
    if len(docs) < docs_per_case * 4:
        raise RuntimeError(f"only {len(docs)} prose paragraphs found on this machine")
    pool = docs[:max(4 * n_real, docs_per_case * 4)]
    real = make_items(llm, pool, n_real, docs_per_case=docs_per_case,
                      questions="mixed" if model_questions else "templates", seed=seed)
    synth = [dict(question=c["question"], documents=c["documents"], system=c.get("system"))
             for c in synthetic_cases(n - n_real, seed=seed)]
    items = real + synth
    random.Random(seed).shuffle(items)
    return items


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description="Print how many paragraphs of installed documentation the packet "
                                        "mixture finds on this machine, and three of them.").parse_args()
    docs = real_documents()
    print(f"{len(docs)} paragraphs; e.g.:")
    for d in docs[:3]:
        print(" -", d[:200])
