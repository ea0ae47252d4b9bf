"""The demo's two questions over its six documents in five orders (the demo's two and three
seeded shuffles): does each setting's answer start with the same 8 tokens as full
attention's (``quality="exact"``)?

    python benchmarks/quality.py demo                                  # defaults vs exact
    python benchmarks/quality.py demo --settings default,isolated,isolated-no-packet --packets my.safetensors
    python benchmarks/quality.py demo --settings isolated --with bridge=bridge.safetensors  # another packet beside
    python benchmarks/quality.py demo --with 'r0.3={"quality": "balanced", "recompute_ratio": 0.3}'
"""
from __future__ import annotations

import argparse
import json
import random

from benchmarks._common import demo_docs
from lazyllm import Chunk, LazyLLM

DOCS = demo_docs()

SYSTEM = "You are a helpful assistant. Answer in one short sentence using only the documents."  # the demo's
QUESTIONS = ["How tall is the Eiffel Tower?", "In which year did Marie Curie win the Nobel Prize in Chemistry?"]
FIRST = ["eiffel", "fuji", "python", "amazon", "curie", "honey"]
SECOND = ["honey", "curie", "eiffel", "amazon", "python", "fuji"]
SETTINGS = {"default": {}, "isolated": {"quality": "isolated"},
            "isolated-no-packet": {"quality": "isolated", "packets": None}, "fast": {"quality": "fast"},
            "balanced": {"quality": "balanced"}}


def orders(n_extra: int = 3, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    out = [FIRST, SECOND]
    while len(out) < 2 + n_extra:
        o = rng.sample(FIRST, len(FIRST))
        if o not in out:
            out.append(o)
    return out


def answers(llm: LazyLLM, cases, n: int) -> list[list[int]]:
    by_id = {name: Chunk(text, id=name) for name, text in DOCS.items()}
    return [llm.generate(q, chunks=[by_id[i] for i in o], system=SYSTEM, max_new_tokens=n).token_ids
            for q, o in cases]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="quality.py demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="default", help=f"comma separated, of {sorted(SETTINGS)} (may be empty)")
    ap.add_argument("--packets", default=None, help="a packet file for the 'isolated' setting (default: shipped)")
    ap.add_argument("--with", dest="extra", action="append", default=[], metavar="NAME=PACKETS|JSON",
                    help="also quality='isolated' with this packet file, or a setting of these LazyLLM options (a "
                         "JSON object), reported as NAME (repeatable)")
    ap.add_argument("--tokens", type=int, default=8)
    a = ap.parse_args(argv)
    cases = [(q, o) for o in orders() for q in QUESTIONS]
    exact = LazyLLM(quality="exact", progress=False)
    ref = answers(exact, cases, a.tokens)
    tok = exact.tokenizer
    exact.close()
    print(f"{'setting':<12} same  answers (first {a.tokens} tokens; * = differs from exact)")
    runs = []
    for name in filter(None, a.settings.split(",")):
        kw = dict(SETTINGS[name])
        if a.packets and name == "isolated":
            kw["packets"] = a.packets
        runs.append((name, kw))
    for name, value in (e.split("=", 1) for e in a.extra):
        runs.append((name, json.loads(value) if value.lstrip().startswith("{")
                     else {"quality": "isolated", "packets": value}))
    for name, kw in runs:
        llm = LazyLLM(progress=False, **kw)
        got = answers(llm, cases, a.tokens)
        llm.close()
        same = sum(g == r for g, r in zip(got, ref))
        print(f"{name:<12} {same:>2}/{len(cases)}")
        for (q, o), g, r in zip(cases, got, ref):
            mark = " " if g == r else "*"
            print(f"   {mark} {q[:28]:<28} [{','.join(x[:2] for x in o)}] {tok.decode(g)!r}"
                  + ("" if g == r else f"  exact: {tok.decode(r)!r}"))

