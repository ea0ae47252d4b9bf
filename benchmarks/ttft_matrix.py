"""TTFT over a grid of request shapes, and the time to the second token, for one tree or two.

A cell is a question of 8 / 50 / 200 tokens over 1 / 4 / 8 / 16 chunks of 128 / 512 / 2,048
tokens, the chunks ``cached`` (computed by an earlier request in another order; each timed
request puts them in a new order with a new question) or ``cold`` (new chunks every request),
the timed request ``after`` a cold request (8 new chunks of 512 tokens, the same
``max_new_tokens``) or ``alone`` (right after the cell's previous request), asking for 1 / 4 / 32
tokens, under a preset (``default``: ``LazyLLM()``'s options; else ``LazyLLM(quality=...)``).
Cell ``B`` is the issue's workload B: two requests over 8 new chunks of 512 (the second in
reverse order, 2 tokens), a cold request over 8 other chunks (with ids, 4 tokens), then 5
requests over shuffled orders of those with new ~50-token questions (4 tokens).

Per request, through the public API and the engine's output processor only (so any tree
measures the same way): *engine* TTFT, from the engine's receipt of the built request
(``Request.submit_time``) to the first token's hand-out; *call* TTFT, from the ``generate``
call to it; the same two for the second token. A cell's figure is the median of ``--reps``
timed requests after one untimed one (new shapes compile and capture there).

    python benchmarks/ttft_matrix.py --tokenizer tok --cells 24 --json new.json
    python benchmarks/ttft_matrix.py --compare old.json new.json     # ratios, worst cell first
    python benchmarks/ttft_matrix.py --tiny --device cpu --cells 3   # the CPU smoke run
    python benchmarks/ttft_matrix.py --tokenizer tok --settings default,balanced,exact --json a.json

``--settings``: instead of cells, workload A (8 cached chunks of ~510 tokens, rotated per
request, and a ~50-token question) under each setting, one row each: the median TTFT (from the
call and engine-side) and the tokens each request prefilled (the question plus what recovery
recomputes); a setting is a preset, ``default``, a named row (``balanced-depth-0.25``, a random
packet ``packet-8+8`` / ``bridge-8+8``) or ``name={"json": "kwargs"}`` (then ``;``-separated).
Every time is taken by ``benchmarks/_common.py``'s ``timed``, the tools' one TTFT timing.

Two trees in one GPU call: ``benchmarks/compare_trees.sh OLD NEW TOK matrix`` starts one
process per tree; they take turns cell by cell (``--turns DIR --side old|new``), each built and
warmed up once, so both see the same machine at nearly the same time.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from dataclasses import dataclass

import torch
from _common import (
    Turns,
    copy_bandwidth,
    device_name,
    gemm_floor_ms,
    llama31_8b_config,
    load_tokenizer,
    random_model,
    run_to_length,
    shrink_to_tiny,
    text_of_tokens,
    timed,
    warm_ttft,
    write_json,
)

QUESTIONS, CHUNKS, CHUNK_TOKENS, NEW_TOKENS = (8, 50, 200), (1, 4, 8, 16), (128, 512, 2048), (1, 4, 32)
SYSTEM = "You answer from the documents."
WORDS = ["alpha", "beta", "gamma", "delta", "omega"]
FIGURES = ("engine_ms", "call_ms", "engine2_ms", "call2_ms")


@dataclass(frozen=True)
class Cell:
    q: int
    n: int
    L: int
    cache: str  # "cached" | "cold"
    after: str  # "after" | "alone"
    t: int
    preset: str = "default"

    @property
    def name(self) -> str:
        return f"q{self.q}-n{self.n}-L{self.L}-{self.cache}-{self.after}-t{self.t}-{self.preset}"

    @classmethod
    def parse(cls, name: str) -> Cell:
        q, n, L, cache, after, t, preset = name.split("-", 6)
        return cls(int(q[1:]), int(n[1:]), int(L[1:]), cache, after, int(t[1:]), preset)


def grid(presets: list[str]) -> list[Cell]:
    return [Cell(*c) for c in itertools.product(QUESTIONS, CHUNKS, CHUNK_TOKENS, ("cached", "cold"),
                                                ("after", "alone"), NEW_TOKENS, presets)]


# the issue's shapes, always in a sample: workload A (``--settings``') and B's warm cells
ANCHORS = ("q50-n8-L512-cached-alone-t1", "q50-n8-L512-cached-alone-t4", "q50-n8-L512-cached-after-t4")


def choose(spec: str, presets: list[str], seed: int = 0) -> list[str]:
    """Cell names: ``all``; a number N (``B``, the anchors and a seeded sample of the rest, N in
    all per preset); or names separated by ``;`` (``B`` for workload B)."""
    if spec == "all":
        return ["B"] + [c.name for c in grid(presets)]
    if not spec.isdigit():
        return [s.strip() for s in spec.split(";") if s.strip()]
    out = ["B"]
    for p in presets:
        anchors = [f"{a}-{p}" for a in ANCHORS]
        rest = [c.name for c in grid([p]) if c.name not in anchors]
        out += anchors + random.Random(seed).sample(rest, max(0, int(spec) - len(anchors)))
    return out


class Texts:
    """Texts of about ``n`` tokens (a chunk segment adds 2), each new, from one seed."""

    def __init__(self, llm, seed: int, scale: float = 1.0):
        self.llm, self.rng, self.scale = llm, random.Random(seed), scale

    def __call__(self, n: int) -> str:
        n = max(2, int(n * self.scale))
        words = [f"{self.rng.choice(WORDS)}{self.rng.randint(0, 999)}" for _ in range(n)]
        lo, hi = 1, len(words)  # the longest prefix of at most n tokens (each word is >= 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.llm.count_tokens(" ".join(words[:mid])) <= n:
                lo = mid
            else:
                hi = mid - 1
        return " ".join(words[:lo])

    def chunks(self, n: int, L: int) -> list[str]:
        return [self(L) for _ in range(n)]


def run_cell(llm, cell: Cell, reps: int, texts: Texts) -> list[dict]:
    """The cell's timed requests (one untimed first). Every text is made before the first
    request, so nothing but the requests runs between them."""
    n_req = reps + 1
    questions = [f"{i} {texts(cell.q)}" for i in range(n_req)]
    before = [texts.chunks(8, 512) if cell.after == "after" else None for _ in range(n_req)]
    if cell.cache == "cached":
        base = texts.chunks(cell.n, cell.L)
        llm.generate("warm " + questions[0], chunks=base[::-1], system=SYSTEM, max_new_tokens=1)
        orders = [random.Random(i).sample(base, len(base)) for i in range(n_req)]
    else:
        orders = [texts.chunks(cell.n, cell.L) for _ in range(n_req)]
    rows = []
    for i in range(n_req):
        if before[i] is not None:
            llm.generate(f"cold {questions[i]}", chunks=before[i], system=SYSTEM, max_new_tokens=cell.t)
        row = timed(llm, questions[i], orders[i], system=SYSTEM, max_new_tokens=cell.t)[0]
        if i:
            rows.append(row)
    return rows


def run_b(llm, texts: Texts) -> list[dict]:
    """Workload B; rows: the cold request (``kind: cold``), then the 5 warm ones."""
    from lazyllm import Chunk

    fresh = texts.chunks(8, 512)
    docs = [Chunk(x, id=f"b{i}-{texts.rng.randint(0, 1 << 30)}") for i, x in enumerate(texts.chunks(8, 512))]
    questions = [texts(50) for _ in range(7)]
    orders = [random.Random(i).sample(docs, len(docs)) for i in range(5)]
    llm.generate(questions[0], chunks=fresh, system=SYSTEM, max_new_tokens=2)
    llm.generate(questions[0], chunks=fresh[::-1], system=SYSTEM, max_new_tokens=2)
    rows = [{"kind": "cold", **timed(llm, questions[1], docs, system=SYSTEM, max_new_tokens=4)[0]}]
    rows += [{"kind": "warm", **timed(llm, questions[2 + i], orders[i], system=SYSTEM, max_new_tokens=4)[0]}
             for i in range(5)]
    return rows


def summary(rows: list[dict]) -> dict:
    """Medians of each figure over ``rows`` (B: of its warm rows; its cold row apart)."""
    warm = [r for r in rows if r.get("kind") != "cold"]
    out = {k: statistics.median(r[k] for r in warm) for k in FIGURES if warm and all(k in r for r in warm)}
    for r in rows:
        if r.get("kind") == "cold":
            out.update({f"cold_{k}": r[k] for k in FIGURES if k in r})
    return out



# a preset's options where its name is not a preset of lazyllm.presets
PRESET_OPTIONS = {"default": {}, "recompute-only": {"quality": "balanced", "escalate_below": 0.0}}
# what an older tree (the baseline of compare_trees.sh) ran for the same options before the
# name existed: ``isolated`` was LazyLLM()'s default, ``balanced`` had no escalation
OLDER_TREE = {"isolated": {}, "recompute-only": {"quality": "balanced"}}


def build(model, tok, preset: str, kv_bytes: int):
    """The engine of ``preset`` over ``model``. Random weights decide nothing, so a setting
    with adaptive recompute would escalate every request: matrix cells measure a preset's
    reuse and recompute, and ``recompute-only`` is ``balanced`` without its escalation
    (an escalated request costs a full prefill: the ``escalated`` row of ``--settings``)."""
    from lazyllm import LazyLLM
    from lazyllm.presets import PRESETS, QUALITY_OPTIONS

    kw = PRESET_OPTIONS.get(preset, {"quality": preset})
    # a tree that lacks the preset or one of its options runs what it had under another name
    known = kw.get("quality") in (None, *PRESETS) and all(k in QUALITY_OPTIONS for k in kw if k != "quality")
    if not known and preset in OLDER_TREE:
        kw = OLDER_TREE[preset]
    llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=kv_bytes, **kw)
    run_to_length(llm)
    return llm


def run_item(name: str, llms: dict, args, item: int) -> list[dict] | str:
    """The rows of item ``name`` (a cell or ``B``), or why it was skipped."""
    scale = 1 / 16 if args.tiny else 1.0
    texts = Texts(llms[next(iter(llms))], seed=1000 * item + 7, scale=scale)
    if name == "B":
        return run_b(llms.get("default") or llms[next(iter(llms))], texts)
    cell = Cell.parse(name)
    if cell.preset not in llms:
        return f"preset {cell.preset} not built here"
    return run_cell(llms[cell.preset], cell, args.reps, texts)


def _floor(model, results: dict, llms: dict) -> None:
    """The weight-read floor of one forward: the weights (less the embedding table, one row a
    token) over the device-to-device copy bandwidth measured now; and the GEMM floor: the
    engine's projection GEMMs alone for workload A's 57 rows (``gemm_floor_ms``), where the
    tree's engine exposes its layers."""
    emb = model.model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - emb.numel() * emb.element_size()
    bw = copy_bandwidth()
    results.update(copy_TBps=bw / 1e12, weight_read_floor_ms=weight_bytes / bw * 1e3)
    llm = next(iter(llms.values()))
    try:
        results["gemm_floor_ms"] = gemm_floor_ms(llm.engine.model, 57)
    except (AttributeError, KeyError) as e:  # an engine without fused layer weights
        results["gemm_floor_error"] = repr(e)


def run(args) -> dict:
    tok = load_tokenizer(args.tokenizer)
    cfg = llama31_8b_config(args.layers)
    if args.tiny:
        shrink_to_tiny(cfg, len(tok))
    cuda = args.device.startswith("cuda")
    model = random_model(cfg, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32)
    presets = args.presets.split(",")
    names = choose(args.cells, presets, args.seed)
    results = {"device": device_name(args.device), "date": time.strftime("%Y-%m-%d %H:%M"), "side": args.side,
               "tiny": args.tiny, "layers": cfg.num_hidden_layers, "reps": args.reps, "cells": {}}
    llms = {}
    for p in presets:
        try:
            llms[p] = build(model, tok, p, args.kv_bytes)
        except Exception as e:  # a preset this tree lacks
            results.setdefault("skipped_presets", {})[p] = repr(e)
    turns = Turns(args.turns, args.side) if args.turns else None
    if turns:
        turns.items = len(names)
        turns.ready()
    deadline = time.perf_counter() + args.budget_s
    for item in range(args.rounds * len(names)):
        name = names[item % len(names)]
        slot = turns.slot(item) if turns else item
        if turns and not turns.wait(slot):
            break
        stop = time.perf_counter() > deadline
        if not stop:
            if cuda and "copy_TBps" not in results:
                _floor(model, results, llms)
            _record(results, name, run_item(name, llms, args, item), args)
        if turns:
            turns.done(slot, stop)
        if stop:
            results["stopped_at"] = f"pass {item // len(names)}, {name}: --budget-s reached"
            break
    for llm in llms.values():
        llm.close()
    return results


def _record(results: dict, name: str, rows, args) -> None:
    cell = results["cells"].setdefault(name, {"passes": [], "rows": []})
    if isinstance(rows, str):
        cell["skipped"] = rows
    else:
        cell["passes"].append(summary(rows))
        cell["rows"].append(rows)
        s = cell["passes"][-1]
        print(f"{name:>42}: " + "  ".join(f"{k} {s[k]:8.2f}" for k in FIGURES if k in s), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


def medians(cell: dict) -> dict:
    """A cell's figures: the median over its passes."""
    keys = {k for p in cell.get("passes", []) for k in p}
    return {k: statistics.median(p[k] for p in cell["passes"] if k in p) for k in keys}


def compare(old_path: str, new_path: str) -> list[dict]:
    """Each cell's new/old ratios (engine TTFT first), the worst engine ratio first."""
    with open(old_path) as fh:
        old = json.load(fh)
    with open(new_path) as fh:
        new = json.load(fh)
    rows = []
    for name in new["cells"]:
        if name not in old["cells"]:
            continue
        o, n = medians(old["cells"][name]), medians(new["cells"][name])
        keys = [k for k in FIGURES + tuple(f"cold_{k}" for k in FIGURES) if k in o and k in n]
        if keys:
            rows.append({"cell": name, **{k: (o[k], n[k], n[k] / o[k]) for k in keys}})
    rows.sort(key=lambda r: -r["engine_ms"][2] if "engine_ms" in r else 0)
    print(f"\nTTFT matrix, {new['device']}, {new['date']}: old {old.get('side')} / new {new.get('side')}; "
          "ms, medians over passes; ratio new/old; worst engine ratio first")
    print("| cell | engine TTFT old -> new | ratio | from the call old -> new | ratio | 2nd token, engine | "
          "2nd token, call |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        def f(k):
            return f"{r[k][0]:.2f} -> {r[k][1]:.2f}" if k in r else "-"

        def x(k):
            return f"{r[k][2]:.3f}" if k in r else "-"
        print(f"| {r['cell']} | {f('engine_ms')} | {x('engine_ms')} | {f('call_ms')} | {x('call_ms')} | "
              f"{f('engine2_ms')} ({x('engine2_ms')}) | {f('call2_ms')} ({x('call2_ms')}) |")
        if "cold_engine_ms" in r:
            print(f"| {r['cell']}, its cold request | {f('cold_engine_ms')} | {x('cold_engine_ms')} | "
                  f"{f('cold_call_ms')} | {x('cold_call_ms')} | | |")
    worse = [r["cell"] for r in rows if r.get("engine_ms", (0, 0, 0))[2] > 1.03]
    print(f"cells above 1.03x on the engine side: {len(worse)} of {len(rows)}" + (f" ({', '.join(worse)})" if worse
                                                                                    else ""))
    if "weight_read_floor_ms" in new:
        fl = new["weight_read_floor_ms"]
        for p in ("isolated", "fast", "default"):
            b = medians(new["cells"].get(f"q50-n8-L512-cached-alone-t4-{p}", {}))
            if b.get("engine_ms"):
                print(f"weight-read floor {fl:.2f} ms (copy {new['copy_TBps']:.2f} TB/s); 50-token question over "
                      f"8 x 512 cached, 4 tokens, {p}: engine {b['engine_ms']:.2f} ms = {b['engine_ms'] / fl:.2f}x "
                      "the floor")
        if "gemm_floor_ms" in new:
            g = new["gemm_floor_ms"]
            print(f"GEMM floor (the engine's projection GEMMs alone, 57 rows, one CUDA graph): {g:.2f} ms = "
                  f"{g / fl:.2f}x the weight-read floor")
    return rows


# -- settings mode (--settings): workload A under each setting, one row each ----------------------

def named_settings() -> dict:
    """The settings ``--settings`` names: ``default``, every preset, and a few measured rows."""
    from lazyllm.presets import PRESETS

    return {"default": {}, **{name: {"quality": name} for name in PRESETS},
            # balanced with the question's first pass over the first quarter of the layers
            "balanced-depth-0.25": {"quality": "balanced", "recompute_selection_depth": 0.25},
            # a packet of random values (speed does not depend on them): "random:H+T", or a
            # bridge packet, its trailer recomputed per request: "random-bridge:H+T"
            "packet-8+8": {"packets": "random:8+8"}, "bridge-8+8": {"packets": "random-bridge:8+8"}}


def random_packets(spec: str, model):
    """``"random:8+8"`` / ``"random-bridge:8+8"`` -> a ``Packets`` of random rows for ``model``."""
    from lazyllm.model.identity import model_id
    from lazyllm.model.llama import LlamaFamilyModel
    from lazyllm.model.packets import Packets

    kind, sizes = spec.split(":")
    kh, kt = (int(x) for x in sizes.split("+"))
    g = torch.Generator().manual_seed(0)
    std = float(model.get_input_embeddings().weight.detach().float().std())
    hidden = model.config.hidden_size
    return Packets(torch.randn(kh, hidden, generator=g) * std, torch.randn(kt, hidden, generator=g) * std,
                   model_id(LlamaFamilyModel(model, fuse=False, fused_kernels=False)),
                   bridge=kind == "random-bridge")


def parse_settings(text: str) -> list[tuple[str, dict]]:
    """``a,b`` (names of ``named_settings``) or ``a;b={"json": "kwargs"}``."""
    parts = text.split(";") if "=" in text else text.split(",")
    named = named_settings()
    out = []
    for part in filter(None, (p.strip() for p in parts)):
        name, _, kw = part.partition("=")
        out.append((name, json.loads(kw)) if kw else (name, named[name]))
    return out


def settings_row(model, tok, name: str, kw: dict, args, texts: dict) -> dict:
    """Workload A under one setting: 8 cached chunks of ~510 tokens (cached by ``warm``) and a
    ~50-token question, each timed request starting with another chunk (full attention then
    reuses only the system prompt); the median TTFT and the prefilled tokens per request."""
    from lazyllm import LazyLLM

    run_kw = dict(kw)
    if str(run_kw.get("packets", "")).startswith("random"):
        run_kw["packets"] = random_packets(run_kw["packets"], model)
    cuda = args.device.startswith("cuda")
    llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=(16 << 30) if cuda else (256 << 20), **run_kw)
    run_to_length(llm)
    if not texts:
        texts["chunks"] = [text_of_tokens(llm, args.chunk_tokens, seed=i) for i in range(args.chunks)]
        texts["question"] = text_of_tokens(llm, 50, seed=99)
    chunks, question = texts["chunks"], texts["question"]
    llm.warm(chunks, system=SYSTEM)  # the chunk-caching presets: every chunk cached (no-op for exact)
    llm.generate("warm-up " + question, chunks=chunks[:1], system=SYSTEM, max_new_tokens=2)
    requests = [(f"{i} {question}", chunks[i % len(chunks):] + chunks[:i % len(chunks)]) for i in range(args.reps)]
    res, outs = warm_ttft(llm, requests, sync=torch.cuda.synchronize if cuda else None, system=SYSTEM)
    out = outs[-1]
    chunk_tokens = sum(len(ids) for k, ids in out.prompt_segments if k == "chunk")
    row = dict(setting=name, kwargs=kw, **res, chunk_tokens=chunk_tokens,
               prefill_tokens=statistics.median(o.usage.prompt_tokens - o.usage.cached_tokens for o in outs),
               recomputed=(chunk_tokens - out.usage.cached_chunk_tokens) / chunk_tokens)
    print(f"{name:>22}: TTFT (from the call) {row['ttft_ms']:8.2f} ms (engine {row['engine_ttft_ms']:.2f})  "
          f"prefill {row['prefill_tokens']:6.0f} tokens  "
          f"recomputed {100 * row['recomputed']:5.1f}% of {chunk_tokens} chunk tokens", flush=True)
    llm.close()
    return row


def run_settings(args) -> dict:
    tok = load_tokenizer(args.tokenizer)
    cfg = llama31_8b_config(args.layers)
    if args.tiny:
        shrink_to_tiny(cfg, len(tok))
    model = random_model(cfg, device=args.device,
                         dtype=torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    results = {"device": device_name(args.device), "date": time.strftime("%Y-%m-%d"),
               "layers": cfg.num_hidden_layers, "tiny": args.tiny, "rows": []}
    texts: dict = {}
    for name, kw in parse_settings(args.settings):
        results["rows"].append(settings_row(model, tok, name, kw, args, texts))
    write_json(args.json, results)
    return results


def _args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true",
                    help="a small random Llama and token counts / 16 (the CPU smoke run)")
    ap.add_argument("--presets", default="default", help="comma separated: default and names of lazyllm.presets")
    ap.add_argument("--cells", default="12", help="all | N (a seeded sample per preset, with B and the anchors) | "
                                                  "names separated by ';'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=None,
                    help="timed requests per cell, after one untimed (default 3); per setting (--settings, "
                         "default 8: at most --chunks, one per rotation)")
    ap.add_argument("--rounds", type=int, default=1, help="passes over the cells")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no cell after this many seconds")
    ap.add_argument("--kv-gib", type=float, default=12.0)
    ap.add_argument("--turns", default=None, help="a folder two processes take turns through")
    ap.add_argument("--side", default="new", choices=("old", "new"))
    ap.add_argument("--compare", nargs=2, metavar=("OLD_JSON", "NEW_JSON"), default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--settings", default=None,
                    help="instead of cells: workload A (8 cached chunks + a 50-token question) under each "
                         "setting, one row each: comma separated names (default, the presets, "
                         "balanced-depth-0.25, packet-8+8, bridge-8+8) or ';' separated name=JSON kwargs")
    ap.add_argument("--chunks", type=int, default=8, help="--settings: chunks per request")
    ap.add_argument("--chunk-tokens", type=int, default=510, help="--settings: tokens per chunk")
    args = ap.parse_args(argv)
    if args.reps is None:
        args.reps = 8 if args.settings else 3
    args.kv_bytes = int(args.kv_gib * (1 << 30)) if not args.tiny else 64 << 20
    return args


def main(argv=None):
    args = _args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.settings:
        return run_settings(args)
    return run(args)


if __name__ == "__main__":
    main()
