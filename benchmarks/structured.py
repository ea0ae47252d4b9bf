"""Cost of grammar-constrained decoding: decode time per output token at a fixed batch,
constrained (a nested JSON Schema per row) against unconstrained, and the schema's compile time.

    python benchmarks/structured.py --device cpu                       # the default model
    python benchmarks/structured.py --device cuda --model 8b --tokenizer tok   # Llama-3.1-8B shapes

Each batch is ``--batch`` requests started together, greedy, with the same prompt (the
schema in the system prompt, as ``response_format`` puts it); the figure is the median decode
step time over the steps that ran all ``--batch`` rows (``Engine.decode_step_log``), divided by
the batch. ``--model 8b`` builds random bf16 weights (benchmarks/_common.py) and runs every
unconstrained request to its length; the tokenizer is the default model's (carry it with
``benchmarks/engine.py --save-tokenizer tok``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _common import llama31_8b_config, load_tokenizer, random_model, run_to_length

# a nested JSON Schema: objects in objects, arrays of objects, a pattern, an enum
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "vip"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"], "additionalProperties": False}},
            "required": ["street", "city", "geo"], "additionalProperties": False},
        "orders": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "total": {"type": "number"}, "paid": {"type": "boolean"}},
            "required": ["id", "total", "paid"], "additionalProperties": False}},
    },
    "required": ["name", "age", "address", "orders"],
    "additionalProperties": False,
}


def step_times(llm, batch: int, **kw) -> list[float]:
    """Decode step times at ``batch`` rows; the unconstrained run gets the same system prompt
    that a JSON ``response_format`` adds (its schema), so both attend over the same prompt."""
    from lazyllm.structured import format_instruction, normalize_response_format

    if "response_format" not in kw:
        kw["system"] = format_instruction(normalize_response_format(NESTED))
    llm.engine.decode_step_log.clear()
    outs = llm.generate_batch([f"Customer record number {i} as JSON." for i in range(batch)], **kw)
    steps = [dt for b, dt in llm.engine.decode_step_log if b == batch]
    return steps, outs


def build(args):

    from lazyllm import LazyLLM

    if args.model == "default":
        return LazyLLM(device=args.device, kv_cache_bytes=2 << 30, quality="isolated")
    model = random_model(llama31_8b_config(args.layers), device=args.device)
    llm = LazyLLM(model=model, tokenizer=load_tokenizer(args.tokenizer), kv_cache_bytes=32 << 30, quality="isolated")
    run_to_length(llm)  # random weights: unconstrained rows run to their length
    return llm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", choices=("default", "8b"), default="default")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48, help="max_new_tokens of each request")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    llm = build(args)
    print(f"{llm!r}, batch {args.batch}, {args.tokens} new tokens, {time.strftime('%Y-%m-%d')}")

    from lazyllm.structured import GrammarCompiler, normalize_response_format

    fmt = normalize_response_format(NESTED)
    comp = GrammarCompiler(llm.tokenizer, llm.model.spec.vocab_size)
    comp._tokenizer()  # the vocabulary's one-time setup, reported apart
    t0 = time.perf_counter()
    comp.compile(fmt.grammar)
    print(f"nested schema compile: {1e3 * (time.perf_counter() - t0):.1f} ms")

    step_times(llm, args.batch, max_new_tokens=4)  # warm-up (and CUDA graphs)
    step_times(llm, args.batch, max_new_tokens=4, response_format=NESTED)
    free, cons = [], []
    for _ in range(args.repeats):
        s, _ = step_times(llm, args.batch, max_new_tokens=args.tokens)
        free += s
        s, outs = step_times(llm, args.batch, max_new_tokens=args.tokens, response_format=NESTED)
        cons += s
    if not free or not cons:
        sys.exit("no step ran the whole batch: raise --tokens")
    f, c = statistics.median(free), statistics.median(cons)
    print(f"unconstrained: {1e3 * f / args.batch:.3f} ms per output token ({len(free)} steps at batch {args.batch})")
    print(f"constrained:   {1e3 * c / args.batch:.3f} ms per output token ({len(cons)} steps at batch {args.batch})")
    print(f"ratio constrained / unconstrained: {c / f:.3f}")
    print("sample constrained output:", outs[0].text[:120])
    if torch.cuda.is_available():
        print(torch.cuda.get_device_name())


if __name__ == "__main__":
    main()
