"""``quality.py``'s built-in corpus: docstrings of the Python standard library cut into
documents of a token budget, and the prompts over them (``what``, ``cloze`` and ``needle``
questions, each in several orders of its documents)."""
from __future__ import annotations

import importlib
import inspect
import random
import re
import warnings
from dataclasses import dataclass

MODULES = [
    "abc", "argparse", "base64", "bisect", "calendar", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "doctest", "email.message", "enum", "fnmatch",
    "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "http.client", "inspect",
    "io", "ipaddress", "json", "json.decoder", "json.encoder", "logging", "logging.handlers", "os",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "shlex", "shutil",
    "smtplib", "socket", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "traceback", "typing", "unittest.case", "urllib.parse", "urllib.request", "uuid",
    "warnings", "weakref", "zipfile",
]

NEEDLES = [
    ("The access code for vault {a} is {b}.", "What is the access code for vault {a}?"),
    ("The locker combination for room {a} is {b}.", "What is the locker combination for room {a}?"),
    ("The badge number of inspector {a} is {b}.", "What is the badge number of inspector {a}?"),
    ("The reservation number for table {a} is {b}.", "What is the reservation number for table {a}?"),
]


# -- corpus --------------------------------------------------------------------------
@dataclass
class Doc:
    name: str  # qualified name of the documented object
    text: str


@dataclass
class Prompt:
    qid: int
    kind: str  # "what", "cloze" or "needle"
    question: str
    chunks: list[str]
    order: int  # index of this chunk order among the question's orders
    gold: int  # position of the answer document in ``chunks``
    answer: str | None = None  # the exact answer (needle prompts)


def _clean_docstring(doc: str) -> str:
    """Prose paragraphs of a docstring: drop doctest and indented (code) lines, join the
    lines of each paragraph."""
    paras, cur = [], []
    for line in doc.splitlines():
        s = line.strip()
        if not s:
            if cur:
                paras.append(" ".join(cur))
                cur = []
            continue
        if s.startswith((">>>", "...")) or line.startswith(("    ", "\t")) or set(s) <= set("-=~*"):
            continue
        cur.append(s)
    if cur:
        paras.append(" ".join(cur))
    text = "\n".join(p for p in paras if len(p) > 20)
    return re.sub(r"[ \t]+", " ", text).strip()


def _sentences(text: str) -> list[str]:
    out = []
    for para in text.split("\n"):
        parts = re.split(r"(?<=[.!?])\s+(?=[A-Z`(\"'])", para)
        out += [p.strip() for p in parts if p.strip()]
    return out


def _docstrings() -> list[tuple[str, str]]:
    """(qualified name, docstring) of stdlib modules and their public top-level objects,
    documented in that module (not inherited), in a fixed order."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for modname in MODULES:
            try:
                mod = importlib.import_module(modname)
            except Exception:
                continue
            if mod.__doc__:
                out.append((modname, inspect.cleandoc(mod.__doc__)))
            for name in sorted(vars(mod)):
                if name.startswith("_"):
                    continue
                obj = vars(mod)[name]
                if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                    continue
                if getattr(obj, "__module__", None) != modname or not obj.__doc__:
                    continue
                out.append((f"{modname}.{name}", inspect.cleandoc(obj.__doc__)))
    return out


def _fit(sents: list[str], count, budget: int) -> str:
    """The longest run of whole sentences from the start that fits ``budget`` tokens (the
    first sentence cut at a word boundary if even it does not fit)."""
    text = ""
    for s in sents:
        t = f"{text} {s}".strip()
        if count(t) > budget:
            break
        text = t
    if not text and sents:
        words = sents[0].split()
        while words and count(" ".join(words)) > budget:
            words = words[: max(1, int(len(words) * 0.9))] if len(words) > 1 else []
        text = " ".join(words)
    return text


def build_corpus(count, chunk_tokens: int) -> list[Doc]:
    """Documents of at most ``chunk_tokens`` tokens (and at least 70% of that), one per
    documented object, sorted by name."""
    docs, seen = [], set()
    for name, raw in _docstrings():
        body = _clean_docstring(raw)
        if not body:
            continue
        sents = _sentences(f"{name}: {body}")
        if count(" ".join(sents)) < 0.7 * chunk_tokens:
            continue
        text = _fit(sents, count, chunk_tokens)
        if count(text) < 0.7 * chunk_tokens or text in seen:
            continue
        seen.add(text)
        docs.append(Doc(name, text))
    return docs


def _cloze(doc: Doc, rng: random.Random) -> tuple[str, str] | None:
    """A sentence of ``doc`` (not its first) with one content word blanked out."""
    sents = [s for s in _sentences(doc.text)[1:] if 40 <= len(s) <= 240]
    if not sents:
        return None
    s = rng.choice(sents)
    words = [w for w in re.findall(r"\b[A-Za-z]{6,}\b", s)]
    if not words:
        return None
    w = rng.choice(words)
    blanked = re.sub(rf"\b{w}\b", "____", s, count=1)
    return (f'Which word fills the blank in this sentence from the documents: "{blanked}"', w)


def build_prompts(docs: list[Doc], *, questions: int, needles: int, docs_per_prompt: int, orders: int,
                  seed: int) -> tuple[list[Prompt], list[str]]:
    """Prompts (each question in ``orders`` chunk orders) and the canonical list of every
    chunk they use (the order they are warmed in)."""
    rng = random.Random(seed)
    k = docs_per_prompt
    pool_size = max(questions, k + 1)
    if len(docs) < pool_size:
        raise SystemExit(f"only {len(docs)} documents of the asked length; need {pool_size} "
                         f"(fewer --questions or smaller --chunk-tokens)")
    pool = rng.sample(docs, pool_size)
    specs = []  # (kind, question, answer, gold text, distractor texts)
    for i in range(questions):
        d = pool[i]
        others = [x.text for j, x in enumerate(pool) if j != i]
        dis = rng.sample(others, k - 1)
        cz = _cloze(d, rng) if i % 2 else None
        if cz is not None:
            specs.append(("cloze", cz[0], None, d.text, dis))
        else:
            specs.append(("what", f"What does `{d.name}` do?", None, d.text, dis))
    used_codes = set()
    for i in range(needles):
        host = pool[i % len(pool)]
        fact, q = NEEDLES[i % len(NEEDLES)]
        while True:
            a, b = rng.randint(2, 99), str(rng.randint(1000, 9999))
            if b not in used_codes:
                used_codes.add(b)
                break
        sents = _sentences(host.text)
        at = rng.randint(1, max(1, len(sents) - 1))
        text = " ".join(sents[:at] + [fact.format(a=a, b=b)] + sents[at:])
        others = [x.text for x in pool if x is not host]
        specs.append(("needle", q.format(a=a), b, text, rng.sample(others, k - 1)))
    prompts = []
    for qid, (kind, question, answer, gold, dis) in enumerate(specs):
        base = [gold] + dis
        perms: list[list[int]] = []
        tries = 0
        while len(perms) < orders:
            p = list(range(k))
            rng.shuffle(p)
            tries += 1
            if p not in perms or tries > 50:
                perms.append(p)
        for o, p in enumerate(perms):
            chunks = [base[j] for j in p]
            prompts.append(Prompt(qid, kind, question, chunks, o, p.index(0), answer))
    canonical = []
    for d in pool:
        if d.text not in canonical:
            canonical.append(d.text)
    for p in prompts:
        for c in p.chunks:
            if c not in canonical:
                canonical.append(c)
    return prompts, canonical
