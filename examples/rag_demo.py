"""RAG demo on the embedded default model, offline.

Two questions over the same six documents, the second with the documents retrieved in
another order: the second request reuses every document's KV (computed once, placed at
new positions by the attention kernel) and only computes its question.

    python examples/rag_demo.py [--reuse lazy|block|prefix|none] [--device auto|cpu|cuda] [--check]

``--check`` also answers each question with full attention (``quality="exact"``, the same
weights) and prints whether the answer's first 8 tokens are full attention's.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus import DOCS  # noqa: E402

from lazyllm import Chunk, LazyLLM  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer in one short sentence using only the documents."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: embedded SmolLM2)")
    ap.add_argument("--quality", default=None, choices=["isolated", "fast", "balanced", "exact"],
                    help="a preset (default: LazyLLM()'s own, which is balanced's)")
    ap.add_argument("--reuse", default=None, choices=["lazy", "block", "prefix", "none"],
                    help="override the preset's reuse mode")
    ap.add_argument("--chunk-context", default=None, choices=["isolated", "prefix"],
                    help="override the preset's chunk context")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--check", action="store_true",
                    help="print whether each answer's first 8 tokens equal full attention's (quality='exact')")
    args = ap.parse_args()

    # The weights load in well under a second: no per-tensor progress bar. (A first run that
    # converts the packaged GGUF model still shows the conversion's progress.)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    print("loading the model ...", flush=True)
    t0 = time.perf_counter()
    llm = LazyLLM(args.model, device=args.device, quality=args.quality, reuse=args.reuse,
                  chunk_context=args.chunk_context)
    print(f"loaded {llm} in {time.perf_counter() - t0:.1f} s\n")
    # full attention over the same weights, for --check
    exact = LazyLLM(model=llm.hf_model, tokenizer=llm.tokenizer, device=args.device, quality="exact",
                    progress=False) if args.check else None

    chunks = [Chunk(text, id=name) for name, text in DOCS.items()]
    first = ["eiffel", "fuji", "python", "amazon", "curie", "honey"]
    second = ["honey", "curie", "eiffel", "amazon", "python", "fuji"]  # same documents, another order
    by_id = {c.id: c for c in chunks}
    rows = []
    for label, question, order in [
        ("cold", "How tall is the Eiffel Tower?", first),
        ("warm", "In which year did Marie Curie win the Nobel Prize in Chemistry?", second),
    ]:
        out = llm.generate(question, chunks=[by_id[i] for i in order], system=SYSTEM,
                           max_new_tokens=args.max_new_tokens)
        rows.append((label, out))
        print(f"[{label}] Q: {question}")
        print(f"       A: {out.text.strip()}")
        print(f"       documents in order: {', '.join(order)}")
        print(f"       TTFT {out.ttft_s * 1000:.1f} ms | prompt {out.usage.prompt_tokens} tokens, "
              f"{out.usage.cached_tokens} reused from cache | {out.usage.completion_tokens} generated")
        if exact is not None:
            ref = exact.generate(question, chunks=[by_id[i] for i in order], system=SYSTEM, max_new_tokens=8)
            same = list(out.token_ids[:8]) == list(ref.token_ids[:8])
            print(f"       first 8 tokens as full attention's: {'yes' if same else 'NO'}"
                  + ("" if same else f" (full attention: {ref.text.strip()!r})"))
        print()
    cold, warm = rows[0][1], rows[1][1]
    print(f"TTFT cold {cold.ttft_s * 1000:.1f} ms -> warm {warm.ttft_s * 1000:.1f} ms "
          f"({cold.ttft_s / max(warm.ttft_s, 1e-9):.1f}x lower); warm request reused "
          f"{warm.usage.cached_tokens}/{warm.usage.prompt_tokens} prompt tokens")
    s = llm.cache_stats()
    print(f"cache: {s['hits']} hits, {s['misses']} misses (hit rate {s['hit_rate']:.0%}), "
          f"{s['reused_tokens']} tokens reused, {s['resident_tokens']} tokens resident "
          f"({s['resident_bytes'] / 2**20:.1f} MiB), {s['evictions']} evictions")
    if exact is not None:
        exact.close()
    llm.close()


if __name__ == "__main__":
    main()
