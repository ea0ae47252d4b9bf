"""TTFT of each ``LazyLLM(quality=...)`` preset on Llama-3.1-8B shapes (random bf16 weights:
speed does not depend on the values), one GPU.

A request of 8 cached chunks of 512 tokens and a 64-token question (the prompt of
``benchmarks/engine.py``); the chunks were cached beforehand (``warm``), and each timed
request puts them in another rotation.
Per preset: median TTFT over ``--reps`` requests, and the prefill tokens per request (the
question plus the chunk tokens recovery recomputes). ``exact`` is full attention with
identical-prefix reuse: every chunk token is prefilled.

    python benchmarks/preset_ttft.py [--layers 32] [--tokenizer DIR] [--json out.json]
    python benchmarks/preset_ttft.py --tiny --device cpu        # a smoke run of the script

See benchmarks/engine.py for carrying the tokenizer to a GPU machine (--save-tokenizer).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from _common import (
    device_name,
    llama31_8b_config,
    load_tokenizer,
    random_model,
    run_to_length,
    shrink_to_tiny,
    text_of_tokens,
)

from lazyllm.presets import PRESETS

SETTINGS = {"default": {}, **{name: {"quality": name} for name in PRESETS},
            # balanced with the question's first pass over the first quarter of the layers
            "balanced-depth-0.25": {"quality": "balanced", "recompute_selection_depth": 0.25},
            # a packet of random values (speed does not depend on them): "random:H+T", or a
            # bridge packet, its trailer recomputed per request: "random-bridge:H+T"
            "packet-8+8": {"packets": "random:8+8"}, "bridge-8+8": {"packets": "random-bridge:8+8"}}


def _random_packets(spec: str, model):
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


def _setting(text: str) -> tuple[str, dict]:
    """``name`` of SETTINGS, or ``name={"json": "kwargs"}``."""
    name, _, kw = text.partition("=")
    return (name, json.loads(kw)) if kw else (name, SETTINGS[name])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small random Llama instead of 8B shapes (smoke run)")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=510)
    ap.add_argument("--reps", type=int, default=8, help="timed requests (at most --chunks: one per rotation)")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="comma separated names of SETTINGS; or ';' separated name=JSON kwargs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from lazyllm import LazyLLM

    tok = load_tokenizer(args.tokenizer)
    cfg = llama31_8b_config(args.layers)
    if args.tiny:
        shrink_to_tiny(cfg, len(tok))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = random_model(cfg, device=args.device, dtype=dtype)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    results = {"device": device_name(args.device),
               "date": time.strftime("%Y-%m-%d"), "layers": cfg.num_hidden_layers, "tiny": args.tiny, "rows": []}
    chunks = question = None
    parts = args.settings.split(";") if "=" in args.settings else args.settings.split(",")
    for name, kw in (_setting(p.strip()) for p in parts if p.strip()):
        run_kw = dict(kw)
        if str(run_kw.get("packets", "")).startswith("random"):
            run_kw["packets"] = _random_packets(run_kw["packets"], model)
        llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=(16 << 30) if args.device.startswith("cuda")
                      else (256 << 20), **run_kw)
        run_to_length(llm)
        if chunks is None:
            chunks = [text_of_tokens(llm, args.chunk_tokens, seed=i) for i in range(args.chunks)]
            question = text_of_tokens(llm, 50, seed=99)
        system = "You answer from the documents."
        llm.warm(chunks, system=system)  # the chunk-caching presets: every chunk cached (no-op for exact)
        llm.generate("warm-up " + question, chunks=chunks[:1], system=system, max_new_tokens=2)
        ttft, engine_side, prefill = [], [], []
        for i in range(args.reps):
            # each request starts with another chunk: full attention reuses only the system prompt
            order = chunks[i % len(chunks):] + chunks[:i % len(chunks)]
            sync()
            out = llm.generate(f"{i} {question}", chunks=order, system=system, max_new_tokens=1)
            ttft.append(out.ttft_s)
            engine_side.append(getattr(out, "engine_ttft_s", None) or out.ttft_s)  # older trees: ttft_s
            prefill.append(out.usage.prompt_tokens - out.usage.cached_tokens)
        chunk_tokens = sum(len(ids) for k, ids in out.prompt_segments if k == "chunk")
        row = dict(setting=name, kwargs=kw, ttft_ms=statistics.median(ttft) * 1e3, ttft_all_ms=[t * 1e3 for t in ttft],
                   engine_ttft_ms=statistics.median(engine_side) * 1e3,
                   prefill_tokens=statistics.median(prefill), chunk_tokens=chunk_tokens,
                   recomputed=(chunk_tokens - out.usage.cached_chunk_tokens) / chunk_tokens)
        results["rows"].append(row)
        print(f"{name:>22}: TTFT (from the call) {row['ttft_ms']:8.2f} ms (engine {row['engine_ttft_ms']:.2f})  "
              f"prefill {row['prefill_tokens']:6.0f} tokens  "
              f"recomputed {100 * row['recomputed']:5.1f}% of {chunk_tokens} chunk tokens", flush=True)
        llm.close()
        del llm
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
