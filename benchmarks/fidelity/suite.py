"""Build the real-prose fidelity suite: cases from Python's library reference, split
train / dev / test by source page, written as JSONL the fidelity report reads.

    apt-get install python3-doc                      # the reStructuredText sources, offline
    python benchmarks/quality.py prose-suite          # rewrites benchmarks/data/prose/
    python benchmarks/quality.py prose-suite --check  # rebuilds in memory, fails if the files differ
    python -m lazyllm.quality benchmarks/data/prose/test.jsonl --settings default,balanced

Every source is one page of the library reference (``library/json.rst.txt``): its sections
and documented objects, markup and code examples removed, are packed into documents of
``--min-tokens``..``--max-tokens`` tokens of the default model's tokenizer. A page belongs to
one split (by a hash of its name), so no document, and no page's vocabulary, is in two
splits. A case is a question, 2 to ``--max-docs`` documents and a system prompt, of one kind:

* ``fact``: what one documented object does; its document among documents of other pages;
* ``fact-same-topic``: the same, its distractors from the same page (same vocabulary);
* ``compare``: how two objects documented in two of the documents differ;
* ``unanswerable``: an object of the same page whose document is left out (and that no
  document included names).

``evidence`` holds the first sentence of the documentation that answers (a fact), for
reading, not a reference answer (the report compares with full attention's answers, not with
this). The build is deterministic for one ``python3.X-doc`` version and one seed;
``sources.json`` beside the JSONL records each page's split and licence.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random

from benchmarks._common import HERE
from benchmarks.fidelity.rst import parse_page

OUT = os.path.join(HERE, "data", "prose")
SPLITS = {"train": 0.5, "dev": 0.17, "test": 0.33}  # fractions of the pages
QUOTA = {"train": 240, "dev": 80, "test": 160}  # cases per split
KINDS = (("fact", 0.3), ("fact-same-topic", 0.25), ("compare", 0.2), ("unanswerable", 0.25))
SYSTEM = "Answer the question in one short sentence, using only the documents. If they do not answer it, say so."
LICENCE = ("PSF-2.0: Python's documentation is licensed under the PSF License Version 2 (examples, recipes and "
           "other code in it are dual licensed under the PSF License Version 2 and the Zero-Clause BSD license); "
           "see https://docs.python.org/3/license.html and /usr/share/doc/{pkg}/copyright")
TEMPLATES = {
    "function": ["What does {n}() do?", "What is {n}() used for?", "According to the documents, what does {n}() do?"],
    "method": ["What does the {n}() method do?", "What is {n}() for?"],
    "class": ["What is {n}?", "What is the {n} class for?"],
    "exception": ["When is {n} raised?", "What does the {n} exception signal?"],
    "option": ["What does the {n} command-line option do?"],
    "other": ["What is {n}?", "What does the documentation say {n} is?"],
}
COMPARE = ["How does {a} differ from {b}?", "What is the difference between {a} and {b}?",
           "Compare {a} and {b}: what does each do?"]


def _kind(k: str) -> str:
    if k in ("function", "coroutinefunction", "decorator"):
        return "function"
    if k in ("method", "classmethod", "staticmethod", "coroutinemethod", "decoratormethod"):
        return "method"
    return {"class": "class", "exception": "exception", "cmdoption": "option"}.get(k, "other")


def _split_of(source: str) -> str:
    h = int(hashlib.sha256(source.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    acc = 0.0
    for name, frac in SPLITS.items():
        acc += frac
        if h <= acc:
            return name
    return "test"


def pack(entries, count, lo: int, hi: int, rng: random.Random) -> list[dict]:
    """A page's entries packed in order into documents of ``lo``..``hi`` tokens (``count``
    counts them); a paragraph longer than ``hi`` is left out. Each document lists the objects
    it documents in full (``facts``: name, kind, summary)."""
    docs, cur, facts, target = [], [], [], rng.randint(lo + 20, hi)

    def close():
        text = "\n\n".join(cur)
        if cur and count(text) >= lo:
            docs.append(dict(text=text, facts=list(facts)))
        cur.clear()
        facts.clear()

    for e in entries:
        paras = [p for p in e.text.split("\n\n") if count(p) <= hi]
        whole = len(paras) == len(e.text.split("\n\n")) and count(e.text) <= hi
        if whole and cur and count("\n\n".join(cur + [e.text])) > hi:
            close()
            target = rng.randint(lo + 20, hi)
        if whole:
            cur.append(e.text)
            if e.kind != "section" and e.summary and len(e.summary.split()) >= 4:
                facts.append(dict(name=e.name, kind=_kind(e.kind), summary=e.summary))
        else:  # too long for one document: its paragraphs, as prose without a fact
            for p in paras:
                if cur and count("\n\n".join(cur + [p])) > hi:
                    close()
                cur.append(p)
        if count("\n\n".join(cur)) >= target:
            close()
            target = rng.randint(lo + 20, hi)
    close()
    return docs


def _question(f: dict, rng: random.Random) -> str:
    return rng.choice(TEMPLATES[f["kind"]]).format(n=f["name"])


def _others(pool, exclude, n, rng, name=None):
    """``n`` documents of ``pool`` not in ``exclude`` (and not naming ``name``)."""
    cand = [d for d in pool if d["key"] not in exclude and (name is None or name.split(".")[-1] not in d["text"])]
    return rng.sample(cand, n) if len(cand) >= n else None


def make_case(kind: str, page: str, docs: dict, rng: random.Random, n_docs: int) -> dict | None:
    """One case of ``kind`` about ``page`` (``docs``: page -> its documents in this split), or
    None where the page cannot make one."""
    mine = docs[page]
    other = [d for p, ds in docs.items() if p != page for d in ds]
    with_facts = [d for d in mine if d["facts"]]
    if not with_facts:
        return None
    if kind == "compare":
        if len(with_facts) < 2:
            return None
        a, b = rng.sample(with_facts, 2)
        fa, fb = rng.choice(a["facts"]), rng.choice(b["facts"])
        rest = _others(mine, {a["key"], b["key"]}, n_docs - 2, rng) or _others(other, (), n_docs - 2, rng)
        chosen, q = [a, b] + rest, rng.choice(COMPARE).format(a=fa["name"], b=fb["name"])
        evidence, answer = [fa["summary"], fb["summary"]], [a["key"], b["key"]]
    else:
        t = rng.choice(with_facts)
        f = rng.choice(t["facts"])
        q, evidence, answer = _question(f, rng), [f["summary"]], [t["key"]]
        if kind == "fact":
            rest = _others(other, (), n_docs - 1, rng)
        elif kind == "fact-same-topic":
            rest = _others(mine, {t["key"]}, n_docs - 1, rng)
        else:  # unanswerable: the answering document is left out, and no document names the object
            rest = _others(mine, {t["key"]}, n_docs, rng, name=f["name"])
            evidence, answer = [], []
        if rest is None:
            return None
        chosen = ([t] if kind != "unanswerable" else []) + rest
    rng.shuffle(chosen)
    return dict(question=q, documents=[d["text"] for d in chosen], system=SYSTEM, kind=kind, source=page,
                doc_sources=[d["key"].rsplit("#", 1)[0] for d in chosen], answer_in=[
                    i for i, d in enumerate(chosen) if d["key"] in answer], evidence=evidence)


def build(src: str, *, seed: int = 0, lo: int = 80, hi: int = 160, max_docs: int = 5,
          quota: dict | None = None, count=None) -> tuple[dict[str, list[dict]], dict]:
    """``({split: cases}, sources)`` from the library reference under ``src``."""
    quota = quota or QUOTA
    pages = sorted(glob.glob(os.path.join(src, "library", "*.rst.txt")))
    if not pages:
        raise SystemExit(f"no library pages under {src}: install python3-doc (apt-get install python3-doc)")
    rng = random.Random(seed)
    by_split: dict[str, dict[str, list]] = {s: {} for s in SPLITS}
    seen_text: set[str] = set()
    for path in pages:
        name = os.path.basename(path)[: -len(".rst.txt")]
        source = f"library/{name}"
        with open(path, encoding="utf-8") as f:
            entries = parse_page(f.read(), name)
        docs = []
        for i, d in enumerate(pack(entries, count, lo, hi, random.Random(f"{seed}:{source}"))):
            if d["text"] in seen_text:  # de-duplicated: a text shared by pages is kept once
                continue
            seen_text.add(d["text"])
            docs.append(dict(d, key=f"{source}#{i}"))
        if docs:
            by_split[_split_of(source)][source] = docs
    out: dict[str, list[dict]] = {}
    for split, docs in by_split.items():
        out[split] = _cases(split, docs, quota[split], rng, max_docs)
    return out, {p: _split_of(p) for s in by_split.values() for p in s}


def _cases(split: str, docs: dict, quota: int, rng: random.Random, max_docs: int) -> list[dict]:
    pages = sorted(docs)
    cases, questions = [], set()
    kinds, weights = zip(*KINDS)
    tries = 0
    while len(cases) < quota and tries < 50 * quota:
        tries += 1
        page = pages[tries % len(pages)] if tries <= len(pages) else rng.choice(pages)
        kind = rng.choices(kinds, weights)[0]
        n_docs = rng.choice([k for k in range(2, max_docs + 1)] + [3, 4])
        c = make_case(kind, page, docs, rng, n_docs)
        if c is None or c["question"] in questions:
            continue
        questions.add(c["question"])
        cases.append(dict(id=f"{split}-{len(cases):03d}", split=split, **c))
    return cases


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="quality.py prose-suite", description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=None, help="python3.X-doc's _sources folder (default: the installed one)")
    ap.add_argument("--out", default=OUT, help="folder for train/dev/test.jsonl and sources.json")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-tokens", type=int, default=80, help="shortest document (default model's tokens)")
    ap.add_argument("--max-tokens", type=int, default=160, help="longest document (at most 1000)")
    ap.add_argument("--max-docs", type=int, default=5, help="most documents a case (at least 2, at most 10)")
    ap.add_argument("--check", action="store_true", help="rebuild and compare with the files in --out")
    a = ap.parse_args(argv)
    if not (2 <= a.max_docs <= 10 and 80 <= a.min_tokens < a.max_tokens <= 1000):
        ap.error("documents: 80 <= min-tokens < max-tokens <= 1000; cases: 2 <= max-docs <= 10")
    src = os.path.realpath(a.src or (sorted(glob.glob("/usr/share/doc/python3.*/html/_sources")) or [""])[-1])
    pkg = _package(src)
    from transformers import AutoTokenizer

    from lazyllm.model.loader import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir(progress=False)))
    count = _counter(tok)
    splits, sources = build(src, seed=a.seed, lo=a.min_tokens, hi=a.max_tokens, max_docs=a.max_docs, count=count)
    files = {f"{s}.jsonl": "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in cs) for s, cs in splits.items()}
    meta = dict(package=pkg, seed=a.seed, min_tokens=a.min_tokens, max_tokens=a.max_tokens, max_docs=a.max_docs,
                tokenizer="SmolLM2-135M-Instruct", cases={s: len(c) for s, c in splits.items()},
                licence=LICENCE.format(pkg=pkg.split("=")[0]),
                sources={p: dict(split=s, licence="PSF-2.0", package=pkg) for p, s in sorted(sources.items())})
    files["sources.json"] = json.dumps(meta, indent=1, ensure_ascii=False) + "\n"
    if a.check:
        bad = [n for n, t in files.items() if _read(os.path.join(a.out, n)) != t]
        print("identical" if not bad else f"differs: {bad}")
        raise SystemExit(1 if bad else 0)
    os.makedirs(a.out, exist_ok=True)
    for n, t in files.items():
        with open(os.path.join(a.out, n), "w", encoding="utf-8") as f:
            f.write(t)
    print(", ".join(f"{s}: {len(c)} cases" for s, c in splits.items()), f"({len(sources)} pages, {pkg})")


def _read(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def _counter(tok):
    cache: dict[str, int] = {}

    def count(text: str) -> int:
        if text not in cache:
            cache[text] = len(tok.encode(text, add_special_tokens=False))
        return cache[text]
    return count


def _package(src: str) -> str:
    """``name=version`` of the Debian package that installed ``src`` (its folder's name when
    dpkg does not know it)."""
    pkg = os.path.basename(os.path.dirname(os.path.dirname(src))) + "-doc"
    try:
        import subprocess

        v = subprocess.run(["dpkg-query", "-W", "-f=${Version}", pkg], capture_output=True, text=True, check=True)
        return f"{pkg}={v.stdout.strip()}"
    except (OSError, subprocess.CalledProcessError):
        return pkg

