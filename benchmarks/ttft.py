"""TTFT of the same request with a cold and with a warm chunk cache, per reuse mode.

Cold: the cache is cleared, so the prefix and every chunk are prefilled. Warm: an earlier
request held the same chunks in another order (and a different question), so in the
chunked modes only the question is prefilled.

    python benchmarks/ttft.py [--device cpu] [--trials 5] [--modes lazy,block,prefix,none]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from corpus import DOCS  # noqa: E402

from lazyllm import Chunk, LazyLLM  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer in one short sentence using only the documents."
QUESTION = "In which year did Marie Curie win the Nobel Prize in Chemistry?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--modes", default="lazy,block,prefix,none")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()
    chunks = [Chunk(t, id=k) for k, t in DOCS.items()]
    rows = []
    base = None
    for mode in args.modes.split(","):
        llm = LazyLLM(args.model, device=args.device, reuse=mode, quality="isolated") if base is None else \
            LazyLLM(model=base.hf_model, tokenizer=base.tokenizer, reuse=mode, quality="isolated")
        base = base or llm
        llm.generate("warm-up", chunks=chunks[:1], max_new_tokens=1)
        cold, warm = [], []
        for _ in range(args.trials):
            llm.clear_cache()
            out_c = llm.generate(QUESTION, chunks=chunks, system=SYSTEM, max_new_tokens=1)
            cold.append(out_c.ttft_s)
            llm.clear_cache()
            llm.generate("What is this about?", chunks=chunks[::-1], system=SYSTEM, max_new_tokens=1)
            out_w = llm.generate(QUESTION, chunks=chunks, system=SYSTEM, max_new_tokens=1)
            warm.append(out_w.ttft_s)
        c, w = statistics.median(cold), statistics.median(warm)
        rows.append(dict(mode=mode, prompt_tokens=out_w.usage.prompt_tokens, cached_tokens=out_w.usage.cached_tokens,
                         cold_ttft_ms=c * 1e3, warm_ttft_ms=w * 1e3, speedup=c / w))
    dev = str(base.device)
    print(f"\nTTFT, same request cold vs warm ({base.model_name}, {dev}, {base.dtype}, median of {args.trials}; "
          f"{time.strftime('%Y-%m-%d')})")
    print("| reuse | prompt tokens | cached when warm | cold TTFT ms (from the call) | warm TTFT ms (from the call) "
          "| cold/warm |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['cold_ttft_ms']:.1f} | "
              f"{r['warm_ttft_ms']:.1f} | {r['speedup']:.1f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
