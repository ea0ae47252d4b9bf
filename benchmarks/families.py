"""Model families on one GPU: Llama-3.1-8B, Qwen3-8B and Gemma-3-4B shapes, random bf16 weights.

For each shape, the engine's figures on the same prompt (8 cached chunks of ~512 tokens and
a ~59-token question, as ``benchmarks/engine.py``):

* warm TTFT: every chunk cached by an earlier request (in another order);
* decode: the median step with exactly 1 and exactly 32 requests decoding (CUDA graphs),
  as ms per step and tokens per second;
* full prefill: the same prompt cold (every chunk prefilled), and transformers' own prefill
  of the same token sequence, for scale;
* whether the model left the fast path: fused per-layer kernels, CUDA graphs, and every
  ``lazyllm`` log warning (a slow fallback names itself there).

Then the acceptance checks: Qwen3-8B within 1.15x of Llama-3.1-8B on warm TTFT and both
decode figures; Gemma-3-4B's warm TTFT within 1.5x of Llama-3.1-8B's, its decode at batch 32
at least 1,500 tokens/s, its full prefill no slower than transformers'.

    python benchmarks/families.py [--models llama,qwen3,gemma3] [--tokenizer DIR] [--json out.json]
    python benchmarks/families.py --dry-run      # CPU, 2 layers, short prompts: the script runs

Only the tokenizer is real (``benchmarks/engine.py`` says how to carry one to a GPU machine).
About 3 minutes on one H200 for the three shapes.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time

import torch
from _common import (
    copy_bandwidth,
    llama31_8b_config,
    load_tokenizer,
    run_to_length,
    step_ms,
    text_of_tokens,
)

MODELS = ("llama", "qwen3", "gemma3")
NAMES = {"llama": "Llama-3.1-8B", "qwen3": "Qwen3-8B", "gemma3": "Gemma-3-4B"}


def qwen3_8b_config(layers: int):
    import transformers

    return transformers.Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        bos_token_id=151643, eos_token_id=151645,
    )


def gemma3_4b_config(layers: int):
    """Gemma 3 4B's text model: 5 local layers (window 1024, RoPE base 10k) to 1 global
    (base 1M, linear scaling 8)."""
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        max_position_embeddings=131072, rms_norm_eps=1e-6, sliding_window=1024,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
        pad_token_id=0,
    )


CONFIGS = {"llama": llama31_8b_config, "qwen3": qwen3_8b_config, "gemma3": gemma3_4b_config}


def random_causal_lm(cfg, device: str, dtype: torch.dtype):
    """A transformers causal LM of ``cfg`` with random weights, built on ``device`` in ``dtype``."""
    import transformers

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


class _Warnings(logging.Handler):
    """Collects the ``lazyllm`` logger's warnings (a slow fallback logs one)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(family: str, tok, args) -> dict:
    from lazyllm import LazyLLM

    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    cfg = CONFIGS[family](args.layers)
    if args.dry_run:
        cfg.vocab_size = len(tok)  # small embeddings on CPU
    t0 = time.perf_counter()
    model = random_causal_lm(cfg, device, dtype)
    res = {"model": NAMES[family], "layers": args.layers, "build_s": time.perf_counter() - t0}
    handler = _Warnings()
    log = logging.getLogger("lazyllm")
    log.addHandler(handler)
    try:
        llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=args.kv_gb << 30, device=device, quality="isolated")
    finally:
        log.removeHandler(handler)
    run_to_length(llm)  # random weights: run every request to its length
    m = llm.model
    res.update(fused_kernels=m.fused is not None, graph_capturable=m.graph_capturable,
               windowed_layers=sum(w is not None for w in m.windows), warnings=handler.messages)
    chunks = [text_of_tokens(llm, args.chunk_tokens, seed=i) for i in range(args.chunks)]
    question = text_of_tokens(llm, args.question_tokens, seed=99)

    # warm TTFT: chunks cached by an earlier request in another order
    llm.generate("warm-up " + question, chunks=chunks[::-1], max_new_tokens=2)
    warm = []
    for i in range(args.reps):
        out = llm.generate(f"{i} {question}", chunks=chunks, max_new_tokens=1)
        warm.append(out.ttft_s)
    res.update(prompt_tokens=out.usage.prompt_tokens, cached_tokens=out.usage.cached_tokens,
               suffix_tokens=len(out.prompt_segments[-1][1]), warm_ttft_ms=statistics.median(warm) * 1e3)
    # full prefill: the same prompt cold, and transformers' prefill of it
    cold = []
    for i in range(3):
        llm.clear_cache()
        cold.append(llm.generate(f"c{i} {question}", chunks=chunks, max_new_tokens=1).ttft_s)
    res["cold_prefill_ms"] = statistics.median(cold) * 1e3
    ids = torch.tensor([out.prompt_token_ids], device=device)
    with torch.inference_mode():
        model(ids, use_cache=True, logits_to_keep=1)
        _sync(device)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            _sync(device)
            times.append(time.perf_counter() - t)
    res["transformers_prefill_ms"] = statistics.median(times) * 1e3

    # decode: each request over the same cached chunks with its own question
    for batch in args.batches:
        reqs = [{"question": f"{b} {question}", "chunks": chunks} for b in range(batch)]
        llm.generate_batch(reqs[:min(batch, 4)], max_new_tokens=4)  # capture graphs, compile
        llm.engine.decode_step_log.clear()
        llm.generate_batch(reqs, max_new_tokens=args.steps)
        ms, n = step_ms(llm, batch)
        res[f"decode_b{batch}_step_ms"], res[f"decode_b{batch}_steps"] = ms, n
        res[f"decode_b{batch}_tok_s"] = batch / ms * 1e3
    res["graphs"] = llm.engine.graph_stats()
    llm.close()
    del llm, model, m
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def checks(results: dict, b_small: int, b_large: int) -> list[tuple[str, bool, str]]:
    """The acceptance checks that the measured shapes allow: ``(what, passed, figures)``."""
    out = []
    ll, qw, ge = (results.get(k) for k in MODELS)
    if ll and qw:
        for key, label, higher in (("warm_ttft_ms", "warm TTFT", False), (f"decode_b{b_small}_step_ms",
                                   f"decode b={b_small}", False), (f"decode_b{b_large}_tok_s", f"decode b={b_large}",
                                   True)):
            ratio = ll[key] / qw[key] if higher else qw[key] / ll[key]
            out.append((f"Qwen3-8B {label} within 1.15x of Llama-3.1-8B", ratio <= 1.15, f"{ratio:.2f}x"))
    if ll and ge:
        ratio = ge["warm_ttft_ms"] / ll["warm_ttft_ms"]
        out.append(("Gemma-3-4B warm TTFT within 1.5x of Llama-3.1-8B", ratio <= 1.5, f"{ratio:.2f}x"))
    if ge:
        tps = ge[f"decode_b{b_large}_tok_s"]
        out.append((f"Gemma-3-4B decode b={b_large} >= 1,500 tok/s", tps >= 1500, f"{tps:,.0f} tok/s"))
        out.append(("Gemma-3-4B full prefill no slower than transformers",
                    ge["cold_prefill_ms"] <= ge["transformers_prefill_ms"],
                    f"{ge['cold_prefill_ms']:.1f} / {ge['transformers_prefill_ms']:.1f} ms"))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--layers", type=int, default=None, help="layers per model (default: the real count)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per request")
    ap.add_argument("--kv-gb", type=int, default=None, help="KV pool size in GiB (default 24; 1 with --dry-run)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, float32, 2 layers, short prompts and batches: checks that the script runs")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not models or any(m not in MODELS for m in models):
        ap.error(f"--models takes a subset of {','.join(MODELS)}")
    layers = {"llama": 32, "qwen3": 36, "gemma3": 34}
    if args.dry_run:
        args.layers = args.layers or 2
        args.chunks, args.chunk_tokens, args.question_tokens = 2, 24, 12
        args.reps, args.steps, args.batches = 2, min(args.steps, 3), (1, 4)
        args.kv_gb = args.kv_gb or 1
    else:
        if not torch.cuda.is_available():
            ap.error("needs CUDA (or --dry-run)")
        args.chunks, args.chunk_tokens, args.question_tokens = 8, 510, 50  # + template: ~59 suffix tokens
        args.reps, args.batches = 10, (1, 32)
        args.kv_gb = args.kv_gb or 24

    tok = load_tokenizer(args.tokenizer)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "dry_run": args.dry_run,
                     "device": "cpu" if args.dry_run else torch.cuda.get_device_name()}
    if not args.dry_run:
        results["copy_TBps"] = copy_bandwidth() / 1e12
    t_all = time.perf_counter()
    fixed_layers = args.layers
    for fam in models:
        args.layers = fixed_layers or layers[fam]
        t = time.perf_counter()
        results[fam] = measure(fam, tok, args)
        results[fam]["wall_s"] = time.perf_counter() - t
        r = results[fam]
        print(f"{NAMES[fam]}: done in {r['wall_s']:.0f} s: " + ", ".join(
            f"{k} {v:.2f}" for k, v in r.items() if isinstance(v, float)), flush=True)
        if args.json:  # each shape as soon as it is measured, so a cut-short run keeps what it has
            with open(args.json, "w") as fh:
                json.dump(results, fh, indent=2, default=str)
    results["wall_s"] = time.perf_counter() - t_all
    b1, bn = args.batches
    print(f"\nModel families on {results['device']}, random {'float32' if args.dry_run else 'bf16'} weights, "
          f"{args.chunks} cached chunks x ~{args.chunk_tokens} tokens + ~{args.question_tokens}-token question, "
          f"{results['date']}")
    print(f"| shape | warm TTFT (from the call) | decode b={b1} | decode b={bn} | full prefill, ours / "
          "transformers | fast path |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for fam in models:
        r = results[fam]
        fast = "fused kernels" if r["fused_kernels"] else "no fused kernels"
        fast += ", CUDA graphs" if r["graph_capturable"] else ", no CUDA graphs"
        if r["warnings"]:
            fast += f"; {len(r['warnings'])} fallback warning(s)"
        print(f"| {r['model']} ({r['layers']} layers) | {r['warm_ttft_ms']:.1f} ms | "
              f"{r[f'decode_b{b1}_step_ms']:.2f} ms | {r[f'decode_b{bn}_tok_s']:,.0f} tok/s | "
              f"{r['cold_prefill_ms']:.0f} / {r['transformers_prefill_ms']:.0f} ms | {fast} |")
    for fam in models:
        for w in results[fam]["warnings"]:
            print(f"warning ({NAMES[fam]}): {w}")
    results["checks"] = [dict(check=c, passed=p, measured=f) for c, p, f in checks(results, b1, bn)]
    if results["checks"]:
        print("\n| acceptance check | measured | |")
        print("| --- | ---: | --- |")
        for c in results["checks"]:
            print(f"| {c['check']} | {c['measured']} | {'pass' if c['passed'] else 'FAIL'} |")
    print(f"\ntotal {results['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
    return results


if __name__ == "__main__":
    main()
