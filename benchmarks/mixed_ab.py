"""Mixed steps on against off, in one run (``python benchmarks/engine.py --mixed-ab``).

Two engines over the same model, ``mixed_steps=False`` and ``mixed_steps=True`` (each with half
the KV budget), measured in alternation for ``--rounds`` rounds, so drift hits both alike:

* warm TTFT: median of 10 requests whose chunks are all cached, one output token;
* b=1 decode: the median step time with exactly one request decoding, and its time per token;
* a stall: a request decoding while a cold request of the same size (new chunks) arrives: the
  longest gap between two of its text deltas, and the cold request's TTFT. Without mixed
  steps the decoding request waits for the cold prefill; with them it decodes through it.

The acceptance figure is the first two within 3% (mixed steps cost nothing where nothing is
prefilled); the third is what mixed steps are for.
"""
from __future__ import annotations

import statistics
import threading
import time

from benchmarks._common import run_to_length, step_ms, text_of_tokens

FIGURES = ("warm_ttft_ms", "decode_b1_step_ms", "decode_b1_tpot_ms", "stall_max_gap_ms", "stall_cold_ttft_ms")


def _stall(llm, args, chunks, question, seed: int) -> tuple[float, float]:
    """The longest gap (ms) between text deltas of a request decoding while a cold request
    arrives, and that cold request's TTFT (ms)."""
    cold = [text_of_tokens(llm, args.chunk_tokens, seed=seed + j) for j in range(args.chunks)]
    stream = llm.stream(f"long {question}", chunks=chunks, max_new_tokens=args.steps)
    it = iter(stream)
    next(it)  # decoding now
    got = {}
    th = threading.Thread(target=lambda: got.setdefault(
        "out", llm.generate(f"cold {question}", chunks=cold, max_new_tokens=1)))
    times = [time.perf_counter()]
    th.start()
    for _ in it:
        times.append(time.perf_counter())
    th.join()
    gaps = [b - a for a, b in zip(times, times[1:])] or [float("nan")]
    return max(gaps) * 1e3, got["out"].ttft_s * 1e3


def _measure(llm, args, chunks, question, rnd: int) -> dict:
    """One round's figures of one engine."""
    llm.generate(f"warm-up {rnd} {question}", chunks=chunks[::-1], max_new_tokens=2)
    ttft = [llm.generate(f"{rnd}.{k} {question}", chunks=chunks, max_new_tokens=1).ttft_s for k in range(10)]
    llm.engine.decode_step_log.clear()
    out = llm.generate(f"b1 {rnd} {question}", chunks=chunks, max_new_tokens=args.steps)
    step, _ = step_ms(llm, 1)
    gap, cold_ttft = _stall(llm, args, chunks, question, seed=7000 + 100 * rnd)
    return dict(warm_ttft_ms=statistics.median(ttft) * 1e3, decode_b1_step_ms=step,
                decode_b1_tpot_ms=out.tpot_s * 1e3, stall_max_gap_ms=gap, stall_cold_ttft_ms=cold_ttft)


def run(args, model, tok, results: dict) -> dict:
    """Build both engines, measure ``args.rounds`` rounds, print the table; returns the
    figures (per system: per-round values and their median) in ``results``."""
    from lazyllm import LazyLLM

    engines = {}
    for name, on in (("off", False), ("on", True)):
        engines[name] = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=args.kv_bytes // 2,
                                page_size=args.page_size, overlap_decode=args.overlap, mixed_steps=on,
                                step_token_budget=args.step_token_budget, quality="isolated")
        run_to_length(engines[name])
    chunks = [text_of_tokens(engines["off"], args.chunk_tokens, seed=i) for i in range(args.chunks)]
    question = text_of_tokens(engines["off"], 50, seed=99)
    rounds = {name: [] for name in engines}
    for rnd in range(args.rounds):
        for name, llm in engines.items():
            rounds[name].append(_measure(llm, args, chunks, question, rnd))
            print(f"  round {rnd} mixed {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[name][-1].items()),
                  flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in FIGURES} for name, rs in rounds.items()}
    results["mixed_ab"] = dict(rounds=rounds, median=med, step_token_budget=args.step_token_budget,
                               mixed_steps=engines["on"].engine.metrics["mixed_steps"])
    print(f"\nMixed steps off/on, {results['model']} on {results['device']}, {args.rounds} rounds, budget "
          f"{args.step_token_budget} tokens ({engines['on'].engine.metrics['mixed_steps']} mixed steps ran)")
    print("| figure (median of rounds) | mixed off | mixed on | on / off |")
    print("| --- | ---: | ---: | ---: |")
    for k in FIGURES:
        a, b = med["off"][k], med["on"][k]
        print(f"| {k} | {a:.2f} | {b:.2f} | {b / a if a else float('nan'):.3f} |")
    for llm in engines.values():
        llm.close()
    return results
