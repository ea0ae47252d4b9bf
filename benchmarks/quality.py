"""Fidelity of chunked attention (lazy / block reuse, with and without recovery) against
full attention, on RAG prompts over text that ships offline.

Documents are docstrings of the Python standard library (``inspect.getdoc``), each cut to
about ``--chunk-tokens`` tokens at a sentence boundary. Questions are of three kinds:
``what`` ("What does `json.dumps` do?"), ``cloze`` (a sentence of one document with a word
blanked out) and ``needle`` (a planted fact such as "The access code for vault 17 is 4821."
inserted into one of the documents; the answer is the exact number). Every question is asked
with ``--orders`` different orders of its documents, each one a separate prompt.

For each prompt, full attention (``reuse="none"``) gives the reference: its greedy answer
(``generate`` at temperature 0) and its teacher-forced logits on that answer (``score``).
Each setting (reuse mode x chunk context x recovery) then scores the same answer tokens on
the same prompt, with its chunks warmed beforehand in another order (so cached KV is reused
at other positions), and generates its own greedy answer to the needle prompts. Reported
per setting:

- top-1 agreement: fraction of answer positions where the setting's argmax equals full
  attention's argmax;
- KL: mean over answer tokens of KL(full || setting), nats per token;
- greedy match: fraction of prompts whose greedy answer equals full attention's token for
  token (the first ``--answer-tokens`` tokens; ``--needle-tokens`` for needle prompts). The
  setting's greedy answer equals the reference iff its teacher-forced argmax is the
  reference token at every answer position (both see the same context up to the first
  difference), so this is read off the scores; on the needle prompts, where the setting
  also generates, the JSON counts any disagreement between the two (``greedy_check_*``);
- needle accuracy: fraction of needle prompts whose greedy answer contains the planted
  answer, and its ratio to full attention's needle accuracy;
- recompute: extra prefill tokens beyond the question and answer (chunk tokens recomputed
  by recovery), as a fraction of the prompt's chunk tokens;
- TTFT: median over ``--ttft-prompts`` solo requests (one new token): cold for full
  attention (it caches nothing), warm chunk cache for the chunked settings.

Greedy answers are generated with ``generate_batch``, and ``--score-workers`` score requests
are in flight at once so that the engine batches them (the full-attention self-check row
would show it if batching changed the numbers); the TTFT requests run one at a time.

    python benchmarks/quality.py                      # full run, default model, CPU
    python benchmarks/quality.py --quick              # a small slice (CI)
    python benchmarks/quality.py --model PATH --chunk-tokens 256 --json out.json
    python benchmarks/quality.py --modes "" --presets fast,balanced,exact   # the LazyLLM(quality=...) presets
    python benchmarks/quality.py --cases tests/data/quality_heldout.jsonl   # the fidelity report on a JSONL

``--cases`` runs ``lazyllm.quality.compare`` (the fidelity report users run on their own data,
whose metric code this benchmark shares) on the given cases instead of the built-in corpus.

Oracle recompute selections (an upper bound for selective recompute, not engine options):
recoveries ``oracle-kv-R``, ``oracle-attn-R``, ``oracle-kvattn-R``, ``oracle-effect-R``, or
``"recompute_selection": "oracle-kv"`` (etc.) in ``--settings-json``, choose the tokens with
full attention's KV and attention over the same prompt (see ``ORACLE_SELECTIONS``); each
oracle setting also reports which tokens it picked (``oracle_picks``).

    python benchmarks/quality.py --modes lazy --contexts prefix --recoveries oracle-kv-0.2,first-4+oracle-kvattn-0.15

Options the engine does not have yet (``recompute_first_tokens``, ``recompute_ratio``) are
detected with ``inspect.signature(LazyLLM.__init__)``; their settings are skipped with a
note. A model that lazyllm does not support is reported as such (exit status 2).

Subcommands (``quality.py NAME --help``; their code is in ``benchmarks/prose/``):

    python benchmarks/quality.py prose --split test --out DIR --slice 10 --jobs 2   # real prose
    python benchmarks/quality.py prose-suite [--check]    # (re)build benchmarks/data/prose/
    python benchmarks/quality.py demo --settings default  # the demo's questions against exact

``prose``: the fidelity report on a split of the real-prose suite, in slices saved as they
finish (``--jobs N`` processes claim slices through claim files), then one table beside the
order floor. ``prose-suite``: builds that suite from Python's library reference. ``demo``: the
demo's two questions over its six documents in five orders, each setting against full
attention's first tokens.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import inspect
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import _common  # noqa: F401  (the repository root on sys.path: benchmarks/_common.py)
import torch

from lazyllm import LazyLLM
from lazyllm.errors import LazyLLMError, UnsupportedModelError
from lazyllm.presets import PRESETS, QUALITY_OPTIONS
from lazyllm.quality import kl_and_agreement  # the fidelity report's metric code

SYSTEM = "You are a helpful assistant. Answer the question briefly, using only the documents."

# quality targets for a reusable setting: agreement with full attention within a recompute budget
THRESHOLDS = {"top1": 0.97, "kl": 0.01, "same_answer": 0.9, "recompute": 0.20, "recompute_long": 0.20,
              "long_chunk_tokens": 256, "needle_rel": 0.98}
SAME_TOKENS = 8  # "same answer": the first this many greedy tokens equal full attention's

# recovery options: LazyLLM keyword -> setting label prefix
RECOVERY_OPTIONS = {"recompute_first_tokens": "first", "recompute_ratio": "ratio"}
_OFF = {"recompute_first_tokens": 0, "recompute_ratio": 0.0}
# how recompute_ratio picks its tokens; "attn-R" settings ask for "attention", the others
# for "deviation" (both explicitly, so a changed default cannot leak into a grid setting)
SELECTION = "recompute_selection"
# LazyLLM keywords that do not change what the model computes (by name, or by these name
# fragments: storage, batching and loading options)
_NEUTRAL_KW = {"self", "model_name_or_path", "model", "tokenizer", "device", "dtype", "kv_cache_bytes",
               "page_size", "attention_backend", "max_batch_tokens", "trust_remote_code", "progress"}
_NEUTRAL_PARTS = ("bytes", "disk", "dir", "path", "cache", "page", "batch", "backend", "thread", "timeout",
                  "progress", "trust", "log")


def _neutral(name: str) -> bool:
    return name in _NEUTRAL_KW or any(part in name for part in _NEUTRAL_PARTS)

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


# -- settings ------------------------------------------------------------------------
@dataclass
class Setting:
    name: str
    kwargs: dict
    reuse: str
    chunk_context: str
    recovery: str = "none"
    is_default: bool = False
    is_reference: bool = False


def available_options() -> dict:
    """LazyLLM's keyword arguments and their defaults."""
    sig = inspect.signature(LazyLLM.__init__)
    out = {k: (None if p.default is inspect.Parameter.empty else p.default) for k, p in sig.parameters.items()}
    # options a preset may set default to None in the signature: their effective default
    for k, v in QUALITY_OPTIONS.items():
        if k in out and out[k] is None:
            out[k] = v
    return out


def recovery_available(opts: dict | None = None) -> dict:
    opts = available_options() if opts is None else opts
    return {k: k in opts for k in RECOVERY_OPTIONS}


def default_setting(opts: dict) -> Setting:
    """The setting ``LazyLLM()`` runs with when nothing is asked for."""
    quality = {k: v for k, v in opts.items() if not _neutral(k)}
    attn = quality.get(SELECTION) == "attention"
    rec = [f"{'attn' if (k == 'recompute_ratio' and attn) else RECOVERY_OPTIONS.get(k, k)}-{v}"
           for k, v in quality.items()
           if k not in ("reuse", "chunk_context", SELECTION) and v not in (None, 0, 0.0, False)]
    return Setting(name="default", kwargs={}, reuse=quality.get("reuse", "lazy"),
                   chunk_context=quality.get("chunk_context", "isolated"), recovery="+".join(rec) or "none",
                   is_default=True)


def build_settings(modes, contexts, recoveries, opts) -> tuple[list[Setting], list[dict]]:
    """The grid of settings, the configured default and a full-attention self-check; and
    the settings skipped because the engine lacks their option.

    A recovery is ``none``, ``first-K`` (``recompute_first_tokens=K``), ``ratio-R``
    (``recompute_ratio=R``, tokens chosen by key deviation), ``attn-R`` (``recompute_ratio=R``
    with ``recompute_selection="attention"``), ``two-R`` (``"two-stage"``), an oracle
    ``oracle-kv-R`` / ``oracle-attn-R`` / ``oracle-kvattn-R`` / ``oracle-effect-R`` (``install_oracle_selection``:
    measurement only) or a combination joined by ``+`` (``first-4+ratio-0.05``).
    A recovery option that defaults to on is passed as off when unused, so a grid setting
    does not silently inherit a changed default."""
    settings = [Setting("full (self-check)", {"reuse": "none"}, "none", "-", is_reference=True)]
    skipped = []
    for reuse in modes:
        for ctx in contexts:
            for rec in recoveries:
                kw = {"reuse": reuse, "chunk_context": ctx}
                # an option that does not default to off is switched off explicitly
                kw.update({opt: _OFF[opt] for opt in RECOVERY_OPTIONS if opts.get(opt, 0) not in (0, None)})
                missing = []
                for part in ([] if rec == "none" else rec.split("+")):
                    kind, val = part.rsplit("-", 1)
                    opt = "recompute_first_tokens" if kind == "first" else "recompute_ratio"
                    if kind not in ("first", "ratio", "attn", "two", *ORACLE_SELECTIONS):
                        raise SystemExit(f"unknown recovery {part!r}")
                    if opt not in opts:
                        missing.append(opt)
                    kw[opt] = int(val) if kind == "first" else float(val)
                    if kind != "first":
                        if SELECTION not in opts:
                            if kind != "ratio":
                                missing.append(SELECTION)
                        else:
                            kw[SELECTION] = {"attn": "attention", "two": "two-stage"}.get(
                                kind, kind if kind in ORACLE_SELECTIONS else "deviation")
                if missing:
                    skipped.append({"setting": f"{reuse}/{ctx}/{rec}",
                                    "reason": "LazyLLM has no " + ", ".join(f"`{m}`" for m in missing)
                                              + " option yet"})
                    continue
                settings.append(Setting(f"{reuse}/{ctx}/{rec}", kw, reuse, ctx, rec))
    d = default_setting(opts)
    # the default is one of the grid settings when it sets nothing beyond reuse, chunk
    # context and the known recovery options, with the same values
    quality = {k: v for k, v in opts.items() if not _neutral(k)}
    unknown = {k: v for k, v in quality.items() if k not in ("reuse", "chunk_context", SELECTION, *RECOVERY_OPTIONS)
               and v not in (None, 0, 0.0, False)}
    for s in settings:
        if s.is_reference or unknown:
            continue
        same = s.reuse == d.reuse and s.chunk_context == d.chunk_context and all(
            (s.kwargs.get(k) or 0) == (quality.get(k) or 0) for k in RECOVERY_OPTIONS if k in quality) and (
            not quality.get("recompute_ratio")
            or s.kwargs.get(SELECTION, "deviation") == quality.get(SELECTION, "deviation"))
        if same:
            s.is_default = True
            return settings, skipped
    d.name = f"default ({d.reuse}/{d.chunk_context}/{d.recovery})"
    settings.append(d)
    return settings, skipped


# -- oracle selection (an upper bound; measurement only) -------------------------------
# Recompute selections that read what a real system does not have: the KV and attention
# of full attention over the same prompt. They are not engine options: the benchmark adds
# them to the engine's selection names for its own process (``install_oracle_selection``).
#   oracle-kv     : tokens whose cached K and V deviate most from full attention's, summed
#                   over every layer (each layer's squared error over its mean squared norm
#                   of full attention's K, resp. V): CacheBlend's ideal criterion;
#   oracle-attn   : tokens the answer attends to most under full attention (softmax mass
#                   from the rows that predict the scored answer tokens, summed over
#                   layers, heads and rows; a generation request: the question's rows);
#   oracle-kvattn : the product of the two, each scaled to its maximum;
#   oracle-effect : per layer, the answer's attention mass on the token times the root of
#                   its relative K+V deviation there (first-order size of the change in the
#                   answer's attention output), summed over layers.
ORACLE_SELECTIONS = ("oracle-kv", "oracle-attn", "oracle-kvattn", "oracle-effect")
ORACLE_LOG: list | None = None  # a list: each oracle choice is recorded here (``oracle_summary``)


@torch.inference_mode()
def full_context_kv(model, ids: torch.Tensor, query_from: int | None = None):
    """Dense causal forward of ``ids`` at positions ``0..n-1`` through every layer (the
    arithmetic of ``probe_keys``). Returns per layer the keys (rotated at their positions)
    and values ``(n, kv_heads, head_dim)``, and with ``query_from`` the attention
    probabilities that rows ``query_from..n-1`` give every position, per layer and summed
    over heads, ``(layers, n - query_from, n)`` float32 (else ``None``)."""
    from lazyllm.kernels.reference import rope_cos_sin

    spec = model.spec
    n = ids.shape[0]
    pos = torch.arange(n, device=ids.device)
    tables = [rope_cos_sin(pos, f, sc) for f, sc in zip(model.inv_freqs, model.rope_scales)]
    group = spec.num_heads // spec.num_kv_heads
    h = model._embed(ids)
    ks, vs, mass = [], [], []
    for w in model.layers:
        q, k, v = model._qkv(h, w, *tables[w["freq"]])
        ks.append(k)
        vs.append(v)
        mask = pos[None, :] <= pos[:, None]
        if w["window"] is not None:
            mask &= pos[:, None] - pos[None, :] < w["window"]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            scale=spec.sm_scale, enable_gqa=group != 1)[0].transpose(0, 1)
        if query_from is not None:
            qq = q[query_from:].transpose(0, 1).float()  # (heads, m, d)
            kk = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # (heads, n, d)
            logits = (qq @ kk.transpose(1, 2)) * spec.sm_scale
            probs = logits.masked_fill(~mask[query_from:], float("-inf")).softmax(-1).sum(0)
            mass.append(probs)
        h = model._finish_layer(h, o, w)
    return ks, vs, (torch.stack(mass) if query_from is not None else None)


def oracle_scores(rec, r) -> torch.Tensor:
    """The oracle's score of every chunk token of request ``r`` (in chunk order, as
    ``Recovery.key_deviation`` returns them), for ``rec.selection``."""
    from lazyllm.kernels.reference import rotate_by_delta

    spans = r.plan.spans
    model, pool = rec.model, rec.pool
    dev = pool.k.device
    prompt = r.prompt_ids
    n_head = spans[-1].start + len(spans[-1].ids)
    ans_from = len(prompt) - r.logit_rows if r.logit_rows > 1 else n_head  # rows predicting the answer
    ks, vs, mass = full_context_kv(model, torch.tensor(prompt, dtype=torch.long, device=dev), n_head)
    pages_t, slots_t, deltas_t, rows_t = rec.chunk_token_slots(r)
    ans_layers = mass[:, ans_from - n_head:].sum(1)[:, rows_t]  # (layers, chunk tokens)
    kv = torch.zeros(len(rows_t), dtype=torch.float32, device=dev)
    effect = torch.zeros_like(kv)
    for li in range(len(ks)):
        inv = model.inv_freqs[model.freq_index[li]]
        kc = rotate_by_delta(pool.k[li][pages_t, slots_t], deltas_t, inv).float()
        vc = pool.v[li][pages_t, slots_t].float()
        kf, vf = ks[li][rows_t].float(), vs[li][rows_t].float()
        d = (kf - kc).pow(2).sum((-1, -2)) / kf.pow(2).sum((-1, -2)).mean().clamp_min(1e-30) + \
            (vf - vc).pow(2).sum((-1, -2)) / vf.pow(2).sum((-1, -2)).mean().clamp_min(1e-30)
        kv += d
        effect += ans_layers[li] * d.sqrt()
    ans = ans_layers.sum(0)
    question = mass[:, :max(ans_from - n_head, 1)].sum((0, 1))[rows_t]  # the question's own rows
    if rec.selection == "oracle-kv":
        score = kv
    elif rec.selection == "oracle-attn":
        score = ans
    elif rec.selection == "oracle-effect":
        score = effect
    else:
        score = (kv / kv.max().clamp_min(1e-30)) * (ans / ans.max().clamp_min(1e-30))
    if ORACLE_LOG is not None:
        ORACLE_LOG.append(dict(
            key=(rec.selection, rec.ratio, rec.first_tokens), scored=r.logit_rows > 1,
            lens=[len(s.ids) for s in spans], ids=[t for s in spans for t in s.ids], score=score.cpu(),
            kv=kv.cpu(), answer_mass=ans.cpu(), question_mass=question.cpu(),
            probe_deviation=rec.key_deviation(r).float().cpu()))
    return score


def _oracle_selection(rec, r, n_pick, exclude):
    """The recovery selection of every ``ORACLE_SELECTIONS`` name (``rec.selection`` says which)."""
    return oracle_scores(rec, r)


def install_oracle_selection() -> None:
    """Let ``LazyLLM(recompute_selection=...)`` take the ``ORACLE_SELECTIONS`` in this
    process: registers them as recovery selections (``lazyllm.config.register_selection``),
    scored by ``oracle_scores``; every other selection is unchanged. Idempotent."""
    from lazyllm.config import register_selection, selection_names

    for name in ORACLE_SELECTIONS:
        if name not in selection_names():
            register_selection(name)(_oracle_selection)


def _wants_oracle(args) -> bool:
    return any(o in (args.recoveries or "") + (args.settings_json or "") for o in ORACLE_SELECTIONS)


def oracle_summary(log: list, key=None) -> dict:
    """What the oracle picked (score requests only; ``key``: one setting's (selection,
    ratio, first tokens)): where in the chunks, how much of it the first tokens of each
    chunk, the engine's own criteria and the other oracle would have picked too, and the
    most frequent picked tokens."""
    rows = [e for e in log if e["scored"] and (key is None or e["key"] == key)]
    if not rows:
        return {}
    picks = n_total = 0
    first4 = first_chunk = in_q_top = in_dev_top = in_ans_top = in_kv_top = 0
    rel_pos = []
    counts: dict[int, int] = {}
    for e in rows:
        sel, ratio, k = e["key"]
        total = len(e["ids"])
        n_pick = min(total, math.ceil(ratio * total))
        top = set(torch.topk(e["score"], n_pick).indices.tolist())

        def top_of(x):
            return set(torch.topk(x, n_pick).indices.tolist())

        q_top, d_top, a_top, kv_top = (top_of(e["question_mass"]), top_of(e["probe_deviation"]),
                                       top_of(e["answer_mass"]), top_of(e["kv"]))
        starts, acc = [], 0
        for n in e["lens"]:
            starts.append(acc)
            acc += n
        for j in top:
            ci = max(c for c in range(len(starts)) if starts[c] <= j)
            i = j - starts[ci]
            first4 += i < 4
            first_chunk += ci == 0
            rel_pos.append(i / max(1, e["lens"][ci] - 1))
            counts[e["ids"][j]] = counts.get(e["ids"][j], 0) + 1
        in_q_top += len(top & q_top)
        in_dev_top += len(top & d_top)
        in_ans_top += len(top & a_top)
        in_kv_top += len(top & kv_top)
        picks += len(top)
        n_total += total
    frequent = sorted(counts.items(), key=lambda kv: -kv[1])[:12]
    return dict(requests=len(rows), picks=picks, chunk_tokens=n_total,
                in_first_4=first4 / picks, in_first_chunk=first_chunk / picks,
                mean_relative_position=statistics.mean(rel_pos),
                overlap_question_attention=in_q_top / picks, overlap_key_deviation_probe=in_dev_top / picks,
                overlap_answer_attention=in_ans_top / picks, overlap_kv_deviation=in_kv_top / picks,
                frequent_token_ids=frequent)


# -- measurement -----------------------------------------------------------------------
def _gen_items(prompts, args):
    return [dict(question=p.question, chunks=p.chunks, system=SYSTEM,
                 max_new_tokens=args.needle_tokens if p.kind == "needle" else args.answer_tokens)
            for p in prompts]


def _score_all(llm, prompts, continuations, workers: int) -> list:
    """``score`` of every prompt (logits included), ``workers`` requests in flight at once so
    that the engine batches their prefills; results in prompt order."""
    def one(i):
        p = prompts[i]
        return llm.score(p.question, chunks=p.chunks, system=SYSTEM, continuation=continuations[i],
                         return_logits=True)

    if workers <= 1:
        return [one(i) for i in range(len(prompts))]
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, range(len(prompts))))


def _ttft(llm, prompts, n: int) -> list[float]:
    out = []
    for p in prompts[:n]:
        out.append(llm.generate(p.question, chunks=p.chunks, system=SYSTEM, max_new_tokens=1).ttft_s)
    return out


def run_reference(llm, prompts, args, log) -> list[dict]:
    t0 = time.perf_counter()
    gens = llm.generate_batch(_gen_items(prompts, args))
    refs = []
    scores = _score_all(llm, prompts, [list(g.token_ids) for g in gens], args.score_workers)
    for p, g, sc in zip(prompts, gens, scores):
        segs = g.prompt_segments
        refs.append(dict(ids=list(g.token_ids), text=g.text, logits=sc.logits, prefilled=sc.prefilled_tokens,
                         suffix_tokens=len(segs[-1][1]), chunk_tokens=sum(len(s) for k, s in segs if k == "chunk"),
                         prompt_tokens=g.usage.prompt_tokens,
                         needle_hit=(p.answer in g.text) if p.answer is not None else None))
    log(f"  reference: {len(prompts)} prompts in {time.perf_counter() - t0:.1f}s")
    return refs


def run_setting(llm, setting: Setting, prompts, refs, canonical, args, log) -> dict:
    t0 = time.perf_counter()
    if setting.reuse in ("lazy", "block"):
        llm.warm(canonical, system=SYSTEM, progress=False)  # in the canonical order: queries reuse at other positions
    t_warm = time.perf_counter() - t0
    kls, agrees, per_prompt, argmaxes = [], [], [], []
    extra_total = chunk_total = 0
    unexpected = 0
    scores = _score_all(llm, prompts, [r["ids"] for r in refs], args.score_workers)
    for p, ref, sc in zip(prompts, refs, scores):
        kl, ag = kl_and_agreement(ref["logits"], sc.logits)
        kls += kl
        agrees += ag
        argmaxes.append(sc.logits.argmax(-1).tolist())
        if setting.reuse in ("lazy", "block"):
            # warm: only the question (suffix) and the answer (less its last token) need computing
            extra = sc.prefilled_tokens - (ref["suffix_tokens"] + len(ref["ids"]) - 1)
        elif setting.is_reference:
            extra = 0
        else:  # full attention with prefix reuse (the exact preset): every chunk token is computed
            extra = ref["chunk_tokens"]
        if setting.recovery == "none" and extra != 0 and setting.reuse in ("lazy", "block"):
            unexpected += 1  # a chunk that was not cached (evicted?): counts as recomputed
        extra_total += extra
        chunk_total += ref["chunk_tokens"]
        per_prompt.append(dict(qid=p.qid, kind=p.kind, order=p.order, tokens=len(kl), kl=sum(kl) / len(kl),
                               top1=sum(ag) / len(ag), prefilled=sc.prefilled_tokens, extra=extra,
                               ref_ids=ref["ids"]))
    t_score = time.perf_counter() - t0 - t_warm
    # greedy match without generating: the setting's greedy answer equals the reference
    # answer token for token iff, teacher-forced on the reference answer, its argmax is the
    # reference token at every position (the contexts agree up to the first difference)
    for pp, ag_ids in zip(per_prompt, argmaxes):
        ref_ids = pp.pop("ref_ids")
        pp["greedy_match"] = ag_ids == ref_ids
        pp["same_answer"] = ag_ids[:SAME_TOKENS] == ref_ids[:SAME_TOKENS]
    # needle accuracy needs the setting's own greedy text: generate the needle prompts
    needle_idx = [i for i, p in enumerate(prompts) if p.answer is not None]
    gens = llm.generate_batch(_gen_items([prompts[i] for i in needle_idx], args)) if needle_idx else []
    needle, mismatched = [], 0
    for i, g in zip(needle_idx, gens):
        pp, p, ref = per_prompt[i], prompts[i], refs[i]
        pp["needle_hit"] = p.answer in g.text
        pp["text"] = g.text
        needle.append(pp["needle_hit"])
        # cross-check of the teacher-forced greedy match against the real generation
        mismatched += pp["greedy_match"] != (list(g.token_ids) == ref["ids"])
    t_gen = time.perf_counter() - t0 - t_warm - t_score
    ttft = _ttft(llm, prompts, args.ttft_prompts)
    n = len(kls)
    res = dict(
        setting=setting.name, reuse=setting.reuse, chunk_context=setting.chunk_context, recovery=setting.recovery,
        kwargs=setting.kwargs, is_default=setting.is_default, is_reference=setting.is_reference,
        tokens=n, top1=sum(agrees) / n, kl=sum(kls) / n, kl_max=max(kls),
        greedy_match=sum(pp["greedy_match"] for pp in per_prompt) / len(per_prompt),
        same_answer=sum(pp["same_answer"] for pp in per_prompt) / len(per_prompt),
        needle_acc=(sum(needle) / len(needle)) if needle else None,
        recompute_frac=extra_total / chunk_total if chunk_total else 0.0,
        prefill_per_prompt=statistics.mean(pp["prefilled"] for pp in per_prompt),
        ttft_ms=statistics.median(ttft) * 1e3 if ttft else None, ttft_all_ms=[t * 1e3 for t in ttft],
        uncached_prompts=unexpected, greedy_check_mismatches=mismatched, greedy_checked=len(gens),
        time_s=dict(warm=t_warm, score=t_score, generate=t_gen, ttft=time.perf_counter() - t0 - t_warm - t_score
                    - t_gen),
        per_kind={},
        prompts=per_prompt,
    )
    for kind in ("what", "cloze", "needle"):
        sel = [(pp, i) for i, pp in enumerate(per_prompt) if pp["kind"] == kind]
        if sel:
            tok = sum(pp["tokens"] for pp, _ in sel)
            res["per_kind"][kind] = dict(
                prompts=len(sel), top1=sum(pp["top1"] * pp["tokens"] for pp, _ in sel) / tok,
                kl=sum(pp["kl"] * pp["tokens"] for pp, _ in sel) / tok,
                greedy_match=sum(pp["greedy_match"] for pp, _ in sel) / len(sel))
    log(f"  {setting.name}: top-1 {res['top1']:.3f}, KL {res['kl']:.4f}, greedy {res['greedy_match']:.2f}, "
        f"recompute {res['recompute_frac']:.3f}  ({time.perf_counter() - t0:.1f}s)")
    return res


def check_thresholds(res: dict, ref_needle: float | None, chunk_tokens: int) -> dict:
    t = THRESHOLDS
    rmax = t["recompute_long"] if chunk_tokens >= t["long_chunk_tokens"] else t["recompute"]
    needle_rel = None
    if res["needle_acc"] is not None and ref_needle:
        needle_rel = res["needle_acc"] / ref_needle
    checks = {"top1": res["top1"] >= t["top1"], "kl": res["kl"] <= t["kl"],
              "same_answer": res["same_answer"] >= t["same_answer"],
              "recompute": res["recompute_frac"] <= rmax,
              "needle": needle_rel is None or needle_rel >= t["needle_rel"]}
    return dict(needle_rel=needle_rel, recompute_max=rmax, checks=checks, meets=all(checks.values()))


# -- report --------------------------------------------------------------------------
def _pct(x, d=1):
    return "-" if x is None else f"{100 * x:.{d}f}%"


def markdown_table(out: dict) -> str:
    n_ans = out["config"]["answer_tokens"]
    lines = [
        f"| setting | top-1 agree | KL nats/tok | same answer ({SAME_TOKENS} tok) | greedy match "
        "| needle acc (vs full) "
        "| recomputed chunk tokens | prefill tok/query | TTFT ms (median) | meets targets |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    ref = out["reference"]
    lines.append(f"| full attention (reference, cold) | 100.0% | 0 | 100% | 100% | {_pct(ref['needle_acc'], 0)} | - | "
                 f"{ref['prefill_per_prompt']:.0f} | {ref['ttft_ms']:.0f} | - |")
    for r in out["results"]:
        name = r["setting"] + (" **(default)**" if r["is_default"] and not r["setting"].startswith("default")
                               else "")
        needle = "-" if r["needle_acc"] is None else (
            f"{_pct(r['needle_acc'], 0)} ({_pct(r['needle_rel'], 0)})" if r["needle_rel"] is not None
            else _pct(r["needle_acc"], 0))
        meets = "-" if r["is_reference"] else ("yes" if r["meets"] else
                                               "no (" + ", ".join(k for k, v in r["checks"].items() if not v) + ")")
        lines.append(f"| {name} | {_pct(r['top1'])} | {r['kl']:.4f} | {_pct(r['same_answer'], 0)} | "
                     f"{_pct(r['greedy_match'], 0)} | {needle} | "
                     f"{_pct(r['recompute_frac'])} | {r['prefill_per_prompt']:.0f} | {r['ttft_ms']:.0f} | {meets} |")
    return "\n".join(lines) + f"\n\n(greedy match: first {n_ans} answer tokens, {out['config']['needle_tokens']} " \
                              f"on needle prompts)"


def _oracle_log_start(on: bool) -> None:
    """Record the oracle's choices from now on (a fresh log), or stop recording."""
    global ORACLE_LOG
    ORACLE_LOG = [] if on else None


def _oracle_picks(tok, log) -> dict:
    """``oracle_summary`` of each oracle setting recorded since ``_oracle_log_start``,
    logged; the frequent tokens as text."""
    out = {}
    for key in sorted({e["key"] for e in ORACLE_LOG or []}):
        summ = oracle_summary(ORACLE_LOG, key)
        if not summ:
            continue
        summ["frequent_tokens"] = [(tok.decode([t]), c) for t, c in summ.pop("frequent_token_ids")]
        name = f"{key[0]}-{key[1]}" + (f"+first-{key[2]}" if key[2] else "")
        out[name] = summ
        log(f"  oracle picks, {name}: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in summ.items()))
    return out


def run_cases(args, log) -> dict:
    """The fidelity report on a JSONL of cases (held-out or your own)."""
    from lazyllm.quality import compare

    settings = ["default"] + [p for p in (args.presets.split(",") if args.presets else PRESETS) if p]
    if args.settings_json:
        settings = [(n, None) for n in settings] + list(json.loads(args.settings_json).items())
    oracle = _wants_oracle(args)
    if oracle:
        install_oracle_selection()
        _oracle_log_start(True)
    llm = LazyLLM(args.model, device=args.device, dtype=args.dtype, reuse="none", kv_cache_bytes=args.kv_cache_mb
                  << 20, progress=False)
    try:
        rep = compare(llm, args.cases, settings, answer_tokens=args.answer_tokens, ttft_cases=args.ttft_prompts,
                      workers=args.score_workers, progress=not args.quiet, kv_cache_bytes=args.kv_cache_mb << 20)
    finally:
        llm.close()
    out = rep.to_dict()
    if oracle:
        out["oracle_picks"] = _oracle_picks(llm.tokenizer, log)
        _oracle_log_start(False)
    out.update(date=time.strftime("%Y-%m-%d"), command="python benchmarks/quality.py " + " ".join(
        sys.argv[1:]), table=rep.to_markdown(), device=str(llm.device), dtype=str(llm.dtype))
    log(out["table"])
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return out


# -- main ------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="subcommands, each with its own --help: prose (the real-prose fidelity "
                                        "report), prose-suite (build its cases), demo (the demo's questions)")
    ap.add_argument("--model", default=None, help="model folder / .gguf / hub id (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--questions", type=int, default=16, help="document questions (what / cloze)")
    ap.add_argument("--needles", type=int, default=8, help="planted-fact questions")
    ap.add_argument("--orders", type=int, default=2, help="chunk orders per question (each a prompt)")
    ap.add_argument("--docs-per-prompt", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=64, help="document length in tokens (at most)")
    ap.add_argument("--answer-tokens", type=int, default=16, help="reference answer length (what / cloze)")
    ap.add_argument("--needle-tokens", type=int, default=20, help="reference answer length (needle)")
    ap.add_argument("--ttft-prompts", type=int, default=8, help="solo requests timed per setting")
    ap.add_argument("--modes", default="lazy,block")
    ap.add_argument("--contexts", default="isolated,prefix")
    ap.add_argument("--recoveries", default="none,first-4,first-16,first-32,ratio-0.05,ratio-0.15",
                    help="none, first-K (recompute_first_tokens=K), ratio-R (recompute_ratio=R, key deviation), "
                         "attn-R (recompute_ratio=R, recompute_selection='attention'), two-R ('two-stage'), "
                         "oracle-kv-R / oracle-attn-R / oracle-kvattn-R / oracle-effect-R (an upper bound that "
                         "reads full attention's KV and attention: measurement only), joined by +")
    ap.add_argument("--score-workers", type=int, default=8,
                    help="score requests in flight at once (batched by the engine; 1: one at a time)")
    ap.add_argument("--kv-cache-mb", type=int, default=512, help="KV pool per engine")
    ap.add_argument("--presets", default="", help=f"comma-separated LazyLLM(quality=...) presets to add: "
                                                  f"{','.join(PRESETS)}")
    ap.add_argument("--cases", default=None,
                    help="a JSONL of your own cases (question, documents, system, reference): run the fidelity "
                         "report (lazyllm.quality.compare) on it instead, with --presets (default: all) and "
                         "--settings-json")
    ap.add_argument("--settings-json", default=None,
                    help="extra settings, a JSON object {name: LazyLLM kwargs}")
    ap.add_argument("--no-self-check", action="store_true", help="skip full attention scored against itself")
    ap.add_argument("--no-default", action="store_true", help="skip LazyLLM()'s own setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="small slice for CI: 4 questions + 2 needles, one order, lazy only, recovery none / "
                         "first-16 (explicit flags still win)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        quick = {"--questions": ("questions", 4), "--needles": ("needles", 2), "--orders": ("orders", 1),
                 "--ttft-prompts": ("ttft_prompts", 2), "--modes": ("modes", "lazy"),
                 "--recoveries": ("recoveries", "none,first-16")}
        for flag, (attr, val) in quick.items():
            if flag not in given:
                setattr(args, attr, val)
    return args


SUBCOMMANDS = {"prose": "benchmarks.prose.report", "prose-suite": "benchmarks.prose.suite",
               "demo": "benchmarks.prose.demo"}


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
        return {}
    args = parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    t_start = time.perf_counter()
    if args.cases:
        return run_cases(args, log)
    if _wants_oracle(args):
        install_oracle_selection()
    opts = available_options()
    rec_avail = recovery_available(opts)
    kv_bytes = args.kv_cache_mb << 20
    try:
        ref_llm = LazyLLM(args.model, device=args.device, dtype=args.dtype, reuse="none", kv_cache_bytes=kv_bytes,
                          progress=False)
    except LazyLLMError as e:  # UnsupportedModelError, ModelLoadError, ...
        unsupported = isinstance(e, UnsupportedModelError)
        what = "is not supported by lazyllm" if unsupported else "could not be loaded"
        msg = f"model {args.model or 'default'!r} {what}: {e}"
        print(f"{'UNSUPPORTED' if unsupported else 'ERROR'}: {msg}", file=sys.stderr)
        out = dict(error=msg, unsupported=unsupported, model=args.model)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        return out
    hf, tok = ref_llm.hf_model, ref_llm.tokenizer
    count = ref_llm.count_tokens
    docs = build_corpus(count, args.chunk_tokens)
    prompts, canonical = build_prompts(docs, questions=args.questions, needles=args.needles,
                                       docs_per_prompt=args.docs_per_prompt, orders=args.orders, seed=args.seed)
    corpus_hash = hashlib.blake2b("\x00".join(canonical).encode(), digest_size=8).hexdigest()
    log(f"model {ref_llm.model_name} on {ref_llm.device} ({ref_llm.dtype}); {len(docs)} candidate documents of "
        f"<= {args.chunk_tokens} tokens; {len(prompts)} prompts ({args.questions} questions + {args.needles} needles "
        f"x {args.orders} orders, {args.docs_per_prompt} documents each); {len(canonical)} distinct chunks")
    for k, ok in rec_avail.items():
        if not ok:
            log(f"note: LazyLLM has no `{k}` option (yet): its settings are skipped")
    settings, skipped = build_settings([m for m in args.modes.split(",") if m], args.contexts.split(","),
                                       [r for r in args.recoveries.split(",") if r], opts)
    settings = [st for st in settings if not ((args.no_self_check and st.is_reference)
                                              or (args.no_default and st.is_default and not st.kwargs))]
    for name in filter(None, args.presets.split(",")):
        p = PRESETS[name]
        rec = "+".join(([f"first-{p['recompute_first_tokens']}"] if p.get("recompute_first_tokens") else [])
                       + ([f"{p.get('recompute_selection', 'deviation')}-{p['recompute_ratio']}"]
                          if p.get("recompute_ratio") else [])) or "none"
        settings.append(Setting(f"preset {name} ({p['reuse']}/{p['chunk_context']}/{rec})", {"quality": name},
                                p["reuse"], p["chunk_context"], rec))
    for name, kw in (json.loads(args.settings_json).items() if args.settings_json else ()):
        settings.append(Setting(name, kw, kw.get("reuse", "lazy"), kw.get("chunk_context", "isolated"), "custom"))
    for k, v in opts.items():
        if not _neutral(k) and k not in ("reuse", "chunk_context", SELECTION, *RECOVERY_OPTIONS) \
                and v not in (None, 0, 0.0, False):
            log(f"note: LazyLLM option `{k}` defaults to {v!r}; this benchmark does not vary it, so every "
                f"chunked setting runs with it")

    # reference: full attention, cold
    ref_llm.generate("Warm-up question?", chunks=["A warm-up document."], max_new_tokens=1)
    refs = run_reference(ref_llm, prompts, args, log)
    ref_ttft = _ttft(ref_llm, prompts, args.ttft_prompts)
    ref_needles = [r["needle_hit"] for r in refs if r["needle_hit"] is not None]
    reference = dict(needle_acc=sum(ref_needles) / len(ref_needles) if ref_needles else None,
                     ttft_ms=statistics.median(ref_ttft) * 1e3, ttft_all_ms=[t * 1e3 for t in ref_ttft],
                     prefill_per_prompt=statistics.mean(r["prefilled"] for r in refs),
                     prompt_tokens=statistics.mean(r["prompt_tokens"] for r in refs),
                     chunk_tokens=statistics.mean(r["chunk_tokens"] for r in refs),
                     answers=[dict(qid=p.qid, kind=p.kind, order=p.order, question=p.question, answer=p.answer,
                                   text=r["text"], needle_hit=r["needle_hit"]) for p, r in zip(prompts, refs)])
    ref_llm.close()

    results = []
    for s in settings:
        try:
            llm = LazyLLM(model=hf, tokenizer=tok, kv_cache_bytes=kv_bytes, progress=False, **s.kwargs)
        except (TypeError, LazyLLMError, ValueError) as e:
            skipped.append({"setting": s.name, "reason": f"{type(e).__name__}: {e}"})
            log(f"note: {s.name} skipped: {e}")
            continue
        oracle = s.kwargs.get(SELECTION) in ORACLE_SELECTIONS
        try:
            llm.generate("Warm-up question?", chunks=["A warm-up document."], max_new_tokens=1)
            _oracle_log_start(oracle)
            res = run_setting(llm, s, prompts, refs, canonical, args, log)
            if oracle:
                res["oracle_picks"] = _oracle_picks(tok, log)
        except (LazyLLMError, NotImplementedError) as e:
            skipped.append({"setting": s.name, "reason": f"{type(e).__name__}: {e}"})
            log(f"note: {s.name} failed: {e}")
            continue
        finally:
            _oracle_log_start(False)
            llm.close()
            del llm
            gc.collect()
        res.update(check_thresholds(res, reference["needle_acc"], args.chunk_tokens))
        results.append(res)
    for sk in skipped:
        log(f"skipped: {sk['setting']}: {sk['reason']}")

    out = dict(
        date=time.strftime("%Y-%m-%d"), command="python benchmarks/quality.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        model=args.model or "default", model_name=str(getattr(hf.config, "_name_or_path", "")),
        device=str(next(hf.parameters()).device), dtype=str(next(hf.parameters()).dtype),
        torch_threads=torch.get_num_threads(), python=platform.python_version(), corpus_hash=corpus_hash,
        config={k: v for k, v in vars(args).items() if k not in ("json", "quiet")},
        thresholds=THRESHOLDS, options_available=rec_avail,
        lazyllm_defaults={k: v for k, v in opts.items() if not _neutral(k)},
        n_prompts=len(prompts), n_chunks=len(canonical), reference=reference, results=results, skipped=skipped,
        wall_s=None,
    )
    out["wall_s"] = time.perf_counter() - t_start
    table = markdown_table(out)
    out["table"] = table
    log("")
    log(f"Fidelity to full attention ({out['model_name'] or out['model']}, {out['device']}, {out['dtype']}; "
        f"{len(prompts)} prompts, {args.docs_per_prompt} documents of <= {args.chunk_tokens} tokens; {out['date']})")
    log(table)
    if skipped:
        log("\nNot measured: " + "; ".join(f"{s['setting']} ({s['reason']})" for s in skipped))
    log(f"\nwall time {out['wall_s']:.0f}s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return out


if __name__ == "__main__":
    res = main()
    sys.exit(2 if res.get("unsupported") else (1 if res.get("error") else 0))
