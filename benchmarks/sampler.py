"""Cost of the batched sampler (``lazyllm.engine.running.sampler.Sampler``) per decode step.

CPU (default): the sampler alone on random ``(batch, vocab)`` logits, batch 1/8/32, for greedy
rows (the argmax the engine takes when no row samples), sampled rows (temperature; temperature
with top-k and top-p) and masked rows (a dense token bitmask per row, filled by a constraint
that copies a precomputed mask, greedy and sampled); median milliseconds per step.

    python benchmarks/sampler.py [--vocab 49152,128256] [--threads 1] [--reps 50]

(49152: the default model's vocabulary; 128256: Llama 3's.)

GPU (``--engine``): the whole decode step of the engine at batch 32, Llama-3.1-8B shapes with
random bf16 weights (as ``benchmarks/engine.py``), each request over the same cached chunks:
unconstrained greedy, unconstrained sampled, and the same with every row under a constraint
with a dense mask (half the vocabulary allowed at random: the host fills and sends a full
bitmask per row per step). Prints the median step time with exactly 32 rows decoding and its
ratio to unconstrained greedy. ``--constraint MODULE:FUNCTION`` adds rows under a real
constraint: ``FUNCTION(tokenizer, vocab_size, index)`` returns a fresh ``TokenConstraint``
per request (e.g. a compiled nested JSON Schema).

    python benchmarks/engine.py --save-tokenizer tok        # where the default model is installed
    python benchmarks/sampler.py --engine --tokenizer tok [--layers 32] [--steps 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from _common import (
    device_name,
    llama31_8b_config,
    load_tokenizer,
    random_model,
    run_to_length,
    shrink_to_tiny,
    step_ms,
    text_of_tokens,
)


class DenseMask:
    """A constraint over a fixed random mask (about half the tokens allowed): its per-step
    host cost is a copy of one row of words, as a grammar's mask fill is at worst."""

    def __init__(self, words: np.ndarray):
        self.words = torch.from_numpy(words)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].copy_(self.words)

    def accept(self, token: int) -> bool:
        return bool((int(self.words[token // 32]) >> (token % 32)) & 1)

    def is_terminated(self) -> bool:
        return False


def dense_words(vocab: int, seed: int) -> np.ndarray:
    from lazyllm.engine.running.sampler import bitmask_words

    rng = np.random.default_rng(seed)
    return rng.integers(-(2 ** 31), 2 ** 31, size=bitmask_words(vocab), dtype=np.int64).astype(np.int32)


def cpu_table(vocab: int, reps: int) -> list[dict]:
    from lazyllm.engine.running.sampler import Sampler
    from lazyllm.types import SamplingParams

    sampler = Sampler(torch.device("cpu"))
    words = dense_words(vocab, 0)
    modes = {"greedy": dict(), "sampled T=0.8": dict(temperature=0.8),
             "sampled T=0.8 top-k 50 top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
             "masked greedy": dict(mask=True), "masked sampled T=0.8": dict(temperature=0.8, mask=True)}
    out = []
    for batch in (1, 8, 32):
        logits = torch.randn(batch, vocab)
        cases = {}
        for name, kw in modes.items():
            kw = dict(kw)
            mask = kw.pop("mask", False)
            cases[name] = [SimpleNamespace(params=SamplingParams(**kw), seed=i, generated=[],
                                           constraint=DenseMask(words) if mask else None) for i in range(batch)]
        times = {name: [] for name in modes}
        for rep in range(reps + 2):  # the modes in turn, so a busy machine slows them alike
            for name, rows in cases.items():
                t = time.perf_counter()
                picks = logits.argmax(-1) if sampler.plain_greedy(rows) else sampler.pick(logits, rows)
                picks.tolist()
                if rep >= 2:
                    times[name].append(time.perf_counter() - t)
        out += [{"batch": batch, "mode": name, "ms": statistics.median(v) * 1e3} for name, v in times.items()]
    return out


def _submit(llm, question, chunks, n, constraint=None, **kw):
    r = llm.inputs.generation(question, chunks, None, max_new_tokens=n, streaming=False, **kw)
    r.constraint = constraint  # a stand-in grammar of known cost, not one a caller can ask for
    return r


def engine_table(args) -> dict:
    from lazyllm import LazyLLM

    tok = load_tokenizer(args.tokenizer)
    cfg = llama31_8b_config(args.layers)
    if args.tiny:  # a smoke run of the whole script (e.g. on CPU), not a measurement
        cfg = shrink_to_tiny(cfg, len(tok))
    model = random_model(cfg, device=args.device, dtype=torch.bfloat16 if args.device != "cpu" else torch.float32)
    llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=(256 << 20) if args.tiny else 24 << 30,
                  overlap_decode=args.overlap, quality="isolated")
    run_to_length(llm)  # random weights: every request runs to its length
    V = cfg.vocab_size
    factory = None
    if args.constraint:
        mod, fn = args.constraint.split(":")
        factory = getattr(importlib.import_module(mod), fn)
    chunks = [text_of_tokens(llm, 510, seed=i) for i in range(8)]
    question = text_of_tokens(llm, 50, seed=99)
    B = args.batch
    words = [dense_words(V, i) for i in range(B)]
    cases = {"greedy": lambda i: ({}, None), "sampled T=0.8 top-p 0.95": lambda i: (
        dict(temperature=0.8, top_p=0.95, seed=i), None),
        "greedy, dense mask": lambda i: ({}, DenseMask(words[i])),
        "sampled, dense mask": lambda i: (dict(temperature=0.8, top_p=0.95, seed=i), DenseMask(words[i]))}
    if factory is not None:
        cases[f"greedy, {args.constraint}"] = lambda i: ({}, factory(tok, V, i))
    res = {"device": device_name(args.device), "date": time.strftime("%Y-%m-%d"), "batch": B,
           "layers": args.layers, "overlap": llm.engine.async_decode, "steps": args.steps, "cases": {}}
    llm.generate_batch([{"question": f"w{b} {question}", "chunks": chunks} for b in range(4)], max_new_tokens=4)
    for rnd in range(args.rounds):
        for name, make in cases.items():
            reqs = []
            for i in range(B):
                kw, cons = make(i)
                reqs.append(_submit(llm, f"{i} {question}", chunks, args.steps, cons, **kw))
            llm.engine.decode_step_log.clear()
            llm.engine.call(lambda reqs=reqs: llm.engine.scheduler.waiting.extend(reqs))
            outs = [llm._wait(r) for r in reqs]
            ms, n = step_ms(llm, B)
            res["cases"].setdefault(name, []).append(ms)
            print(f"round {rnd}: {name}: {ms:.3f} ms per step at batch {B} ({n} steps), "
                  f"{sum(len(o.token_ids) for o in outs)} tokens", flush=True)
    base = statistics.median(res["cases"]["greedy"])
    print(f"\nDecode step at batch {B}, Llama-3.1-8B shapes ({args.layers} layers), random bf16 weights, "
          f"{res['device']}, {res['date']}, overlap {'on' if res['overlap'] else 'off'}")
    print("| rows | ms per step (median of rounds) | vs greedy |")
    print("| --- | ---: | ---: |")
    for name, v in res["cases"].items():
        m = statistics.median(v)
        print(f"| {name} | {m:.3f} | {m / base:.3f}x |")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", default="49152,128256", help="vocabulary sizes, comma-separated")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (a busy machine: 1 is steadier)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--engine", action="store_true", help="the engine's decode step on a GPU (see the docstring)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model: a smoke run of --engine (CPU)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--constraint", default=None, help="MODULE:FUNCTION(tokenizer, vocab_size, index)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.engine:
        res = engine_table(args)
    else:
        torch.set_num_threads(args.threads)
        res = {"device": "cpu", "threads": args.threads, "tables": {}}
        for vocab in (int(v) for v in args.vocab.split(",")):
            rows = cpu_table(vocab, args.reps)
            res["tables"][vocab] = rows
            modes = list(dict.fromkeys(r["mode"] for r in rows))
            print(f"\nSampler per step on CPU ({args.threads} thread(s)), vocab {vocab}, {time.strftime('%Y-%m-%d')}")
            print("| batch | " + " | ".join(modes) + " |")
            print("| ---: |" + " ---: |" * len(modes))
            for b in (1, 8, 32):
                print(f"| {b} | " + " | ".join(f"{r['ms']:.2f} ms" for r in rows if r["batch"] == b) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
