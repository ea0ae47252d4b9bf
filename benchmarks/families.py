"""Model families on one GPU (Llama-3.1-8B, Qwen3-8B and Gemma-3-4B shapes, random bf16
weights): the engine's figures per family, time to ready and the first request.

``--mode figures`` (the default): for each shape, the engine's figures on the same prompt (8
cached chunks of ~512 tokens and a ~59-token question, as ``benchmarks/engine.py``):

* warm TTFT: every chunk cached by an earlier request (in another order);
* decode: the median step with exactly 1 and exactly 32 requests decoding (CUDA graphs),
  as ms per step and tokens per second;
* full prefill: the same prompt cold (every chunk prefilled), and transformers' own prefill
  of the same token sequence, for scale;
* whether the model left the fast path: fused per-layer kernels, CUDA graphs, and every
  ``lazyllm`` log warning (a slow fallback names itself there).

Then the acceptance checks: Qwen3-8B within 1.15x of Llama-3.1-8B on warm TTFT and both
decode figures; Gemma-3-4B's warm TTFT within 1.5x of Llama-3.1-8B's, its decode at batch 32
at least 1,500 tokens/s, its full prefill no slower than transformers'. About 3 minutes on one
H200 for the three shapes.

``--mode ready``: per shape (``--models``), two processes one after the other on the same
Triton cache folder, empty for the first (a temporary ``TRITON_CACHE_DIR``): time to ready
(``LazyLLM(...)`` with its warm-up; the weights' construction apart), the warm-up's report,
then the first request after ready against the steady figure of the same shape (8 chunks of
~510 tokens + a ~50-token question: cold chunks, then cached chunks in another order; steady:
the median of the next ones), and the kernels compiled after ready.
``--mode loop``: the closed loop that motivated the warm-up, Llama shapes, in one process on an
empty Triton cache: ``generate_batch`` of 128 requests over 100 documents of 1,024 tokens, 5 per
request by Zipf (alpha 2.1), 32 output tokens, the KV budget a third of the corpus
(``benchmarks/rag_serving.py``'s documents and requests). Three passes of the same requests:
the first after ready, the second on the cache the first left, the third after
``clear_cache()`` (warm kernels, cold cache: only compiles and captures differ from the
first); requests/s, TTFT p50, chunk hit rate, kernels compiled and graphs captured during
each. ``--mode first-request``: both. Acceptance: first pass within 10% of the next one's
requests/s with zero kernels compiled after ready; first request TTFT at most 2x the steady
TTFT; time to ready on a warm cache at most 20 s for 8B shapes.

    python benchmarks/families.py [--models llama,qwen3,gemma3] [--tokenizer DIR] [--json out.json]
    python benchmarks/families.py --mode ready --models llama,gemma3 --tokenizer .gpu/tok
    python benchmarks/families.py --mode loop --tokenizer .gpu/tok
    python benchmarks/families.py --dry-run [--mode first-request]   # CPU, tiny shapes: it runs

Only the tokenizer is real (``benchmarks/engine.py`` says how to carry one to a GPU machine).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch
from _common import (
    CONFIGS,
    MODELS,
    NAMES,
    Warnings,
    copy_bandwidth,
    load_tokenizer,
    random_causal_lm,
    run_to_length,
    shrink_to_tiny,
    sibling,
    step_ms,
    text_of_tokens,
    timed,
    warm_ttft,
    write_json,
)

TAG = "FIRST_REQUEST_RESULT "


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def hf_prefill_ms(model, token_ids, device) -> float:
    """transformers' own prefill of ``token_ids`` (the last row's logits), median of 3 (ms)."""
    ids = torch.tensor([token_ids], device=device)
    with torch.inference_mode():
        model(ids, use_cache=True, logits_to_keep=1)
        _sync(device)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            _sync(device)
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(family: str, tok, args) -> dict:
    """One shape's figures (``--mode figures``)."""
    from lazyllm import LazyLLM

    device = "cpu" if args.dry_run else "cuda"
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    cfg = CONFIGS[family](args.layers)
    if args.dry_run:
        cfg.vocab_size = len(tok)  # small embeddings on CPU
    t0 = time.perf_counter()
    model = random_causal_lm(cfg, device, dtype)
    res = {"model": NAMES[family], "layers": args.layers, "build_s": time.perf_counter() - t0}
    handler = Warnings()
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
    warm, outs = warm_ttft(llm, [(f"{i} {question}", chunks) for i in range(args.reps)])
    out = outs[-1]
    res.update(prompt_tokens=out.usage.prompt_tokens, cached_tokens=out.usage.cached_tokens,
               suffix_tokens=len(out.prompt_segments[-1][1]), warm_ttft_ms=warm["ttft_ms"])
    # full prefill: the same prompt cold, and transformers' prefill of it
    cold = []
    for i in range(3):
        llm.clear_cache()
        cold.append(timed(llm, f"c{i} {question}", chunks, max_new_tokens=1)[0]["ttft_ms"])
    res["cold_prefill_ms"] = statistics.median(cold)
    res["transformers_prefill_ms"] = hf_prefill_ms(model, out.prompt_token_ids, device)

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


LAYERS = {"llama": 32, "qwen3": 36, "gemma3": 34}


def _config(family: str, smoke: bool, vocab: int):
    cfg = CONFIGS[family](LAYERS[family])
    if smoke:
        shrink_to_tiny(cfg, vocab)
        if family == "gemma3":
            cfg.layer_types = cfg.layer_types[:cfg.num_hidden_layers]
            cfg.head_dim, cfg.query_pre_attn_scalar = 16, 16
    return cfg


def _build(family: str, args, tok):
    """``(model, cfg, build seconds)``: random weights in the family's shapes."""
    device, dtype = ("cpu", torch.float32) if args.dry_run else ("cuda", torch.bfloat16)
    cfg = _config(family, args.dry_run, len(tok))
    t = time.perf_counter()
    model = random_causal_lm(cfg, device, dtype)
    if device == "cuda":
        torch.cuda.synchronize()
    return model, cfg, time.perf_counter() - t


def _ready(model, tok, **kw):
    """``(llm, seconds)``: ``LazyLLM`` made, its warm-up included (on by default)."""
    from lazyllm import LazyLLM

    t = time.perf_counter()
    llm = LazyLLM(model=model, tokenizer=tok, packets=None, **kw)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    return llm, time.perf_counter() - t


def child_ready(family: str, args) -> dict:
    """One process: time to ready, first request against steady, compiles after ready."""
    tok = load_tokenizer(args.tokenizer)
    model, _, build_s = _build(family, args, tok)
    kw = dict(kv_cache_bytes=(64 << 20) if args.dry_run else args.kv_gb << 30)
    if args.dry_run:
        kw["device"] = "cpu"
    llm, ready_s = _ready(model, tok, **kw)
    report = llm.warmup()
    run_to_length(llm)
    n_chunk, n_q = (24, 12) if args.dry_run else (510, 50)

    def chunks(seed):
        return [text_of_tokens(llm, n_chunk, seed=seed * 100 + i) for i in range(8)]

    q = [text_of_tokens(llm, n_q, seed=9000 + i) for i in range(8)]
    sets = [chunks(s) for s in range(4)]
    g0 = llm.engine.graph_stats()

    engine_side = []  # (TTFT from the call, from the engine's receipt), every request in order

    def ttft(question, docs):
        row = timed(llm, question, docs, max_new_tokens=2)[0]
        engine_side.append((row["ttft_ms"], row["engine_ttft_ms"]))
        return row["ttft_ms"] / 1e3

    first_cold = ttft(q[0], sets[0])
    first_cached = ttft(q[1], sets[0][::-1])
    steady_cold = statistics.median(ttft(q[2 + i], sets[1 + i]) for i in range(3))
    steady_cached = statistics.median(ttft(q[5 + i % 3], random.Random(i).sample(sets[0], 8)) for i in range(5))
    g1 = llm.engine.graph_stats()
    out = dict(model=family, build_s=build_s, ready_s=ready_s, warmup=report, first_cold_ms=first_cold * 1e3,
               steady_cold_ms=steady_cold * 1e3, first_cached_ms=first_cached * 1e3,
               steady_cached_ms=steady_cached * 1e3, ttft_call_and_engine_ms=engine_side,
               compiled_after_ready=llm.cache_stats()["kernels_compiled_after_ready"],
               graphs_after_ready=(g1["decode_graphs"] + g1["prefill_graphs"]) - (g0["decode_graphs"] +
                                                                                   g0["prefill_graphs"]),
               capture_s_after_ready=g1["capture_s"] - g0["capture_s"])
    llm.close()
    return out


def _loop_workload(tok, args):
    rs = sibling("rag_serving")
    ns = types.SimpleNamespace(seed=0, docs=args.docs, doc_tokens=args.doc_tokens, k=args.k)
    docs = rs.make_docs(tok, ns)
    reqs = rs.make_requests(tok, ns, args.alpha, "first-request", args.requests)
    return docs, reqs, rs


def child_loop(args) -> dict:
    """One process on an empty Triton cache: three passes of the closed loop."""
    tok = load_tokenizer(args.tokenizer)
    model, cfg, build_s = _build("llama", args, tok)
    docs, reqs, rs = _loop_workload(tok, args)
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    budget = max(int(rs.kv_bytes_per_token(cfg, dtype) * args.docs * args.doc_tokens / 3), 1 << 20)
    kw = dict(kv_cache_bytes=budget)
    if args.dry_run:
        kw["device"] = "cpu"
    llm, ready_s = _ready(model, tok, **kw)
    run_to_length(llm)
    batch = [dict(question=r.question, chunks=[docs[i] for i in r.doc_ids], max_new_tokens=args.output_tokens)
             for r in reqs]
    passes = []
    for label in ("first", "second", "after clear_cache"):
        if label == "after clear_cache":
            llm.clear_cache()
        late0, g0, c0 = llm.cache_stats()["kernels_compiled_after_ready"], llm.engine.graph_stats(), \
            dict(llm.store.counters.__dict__)
        t = time.perf_counter()
        outs = llm.generate_batch(batch)
        wall = time.perf_counter() - t
        g1, c = llm.engine.graph_stats(), llm.store.counters
        chunk_tokens = sum(n for o in outs for kind, ids in o.prompt_segments if kind == "chunk" for n in [len(ids)])
        passes.append(dict(
            label=label, wall_s=wall, req_per_s=len(outs) / wall,
            ttft_p50_ms=statistics.median(o.ttft_s for o in outs) * 1e3,
            chunk_hit_rate=sum(o.usage.cached_chunk_tokens for o in outs) / max(chunk_tokens, 1),
            compiled=llm.cache_stats()["kernels_compiled_after_ready"] - late0,
            graphs=sum(g1[k] - g0[k] for k in ("decode_graphs", "prefill_graphs")),
            capture_s=g1["capture_s"] - g0["capture_s"], misses=c.misses - c0["misses"]))
    out = dict(model="llama", build_s=build_s, ready_s=ready_s, warmup=llm.warmup(), passes=passes)
    llm.close()
    return out


def _spawn(args, child: list[str], cache_dir: str) -> dict:
    """Run this script as a child (a fresh process) with ``TRITON_CACHE_DIR=cache_dir``; its
    result line, parsed."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir)
    cmd = [sys.executable, os.path.abspath(__file__), *child, "--tokenizer", args.tokenizer or "",
           "--kv-gb", str(args.kv_gb)] + (["--dry-run"] if args.dry_run else [])
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    line = next((x for x in p.stdout.splitlines() if x.startswith(TAG)), None)
    if p.returncode or line is None:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-8000:])
        raise SystemExit(f"child {' '.join(child)} failed (exit {p.returncode})")
    late = [x for x in p.stderr.splitlines() if "after the engine was ready" in x]
    res = json.loads(line[len(TAG):])
    res.update(process_s=wall, late_kernels=late[:20])
    return res


def _print_ready(rows) -> None:
    print("\n| shape | cache | time to ready | warm-up (kernels, graphs) "
          "| first / steady TTFT (from the call), cold chunks "
          "| first / steady TTFT, cached chunks | compiled after ready | graphs after ready |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        w = r["warmup"]
        print(f"| {r['model']} | {r['cache']} | {r['ready_s']:.1f} s | {w['seconds']:.1f} s "
              f"({w['kernels_compiled']}, {w['decode_graphs']}+{w['prefill_graphs']}) "
              f"| {r['first_cold_ms']:.1f} / {r['steady_cold_ms']:.1f} ms "
              f"({r['first_cold_ms'] / r['steady_cold_ms']:.2f}x) "
              f"| {r['first_cached_ms']:.1f} / {r['steady_cached_ms']:.1f} ms "
              f"({r['first_cached_ms'] / r['steady_cached_ms']:.2f}x) "
              f"| {r['compiled_after_ready']} | {r['graphs_after_ready']} ({r['capture_s_after_ready']:.2f} s) |")
        for name in r["late_kernels"]:
            print(f"    late: {name}")


def _print_loop(r) -> None:
    w = r["warmup"]
    print(f"\nClosed loop, Llama shapes, empty Triton cache: ready in {r['ready_s']:.1f} s (warm-up "
          f"{w['seconds']:.1f} s, {w['kernels_compiled']} kernels, {w['decode_graphs']}+{w['prefill_graphs']} graphs)")
    print("| pass | requests/s | TTFT p50 (from the call) | chunk hit rate | compiled | graphs captured (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for p in r["passes"]:
        print(f"| {p['label']} | {p['req_per_s']:.2f} | {p['ttft_p50_ms']:.0f} ms | {p['chunk_hit_rate']:.2f} "
              f"| {p['compiled']} | {p['graphs']} ({p['capture_s']:.2f}) |")
    first, second = r["passes"][0]["req_per_s"], r["passes"][1]["req_per_s"]
    print(f"first / second pass: {first / second:.2f}; first / after clear_cache: "
          f"{first / r['passes'][2]['req_per_s']:.2f}")
    for name in r["late_kernels"]:
        print(f"    late: {name}")


def figures(args) -> dict:
    """``--mode figures``: each shape's figures, the table and the acceptance checks."""
    models = args.models
    if args.dry_run:
        args.layers = args.layers or 2
        args.chunks, args.chunk_tokens, args.question_tokens = 2, 24, 12
        args.reps, args.steps, args.batches = 2, min(args.steps, 3), (1, 4)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs CUDA (or --dry-run)")
        args.chunks, args.chunk_tokens, args.question_tokens = 8, 510, 50  # + template: ~59 suffix tokens
        args.reps, args.batches = 10, (1, 32)

    tok = load_tokenizer(args.tokenizer)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "dry_run": args.dry_run,
                     "device": "cpu" if args.dry_run else torch.cuda.get_device_name()}
    if not args.dry_run:
        results["copy_TBps"] = copy_bandwidth() / 1e12
    t_all = time.perf_counter()
    fixed_layers = args.layers
    for fam in models:
        args.layers = fixed_layers or LAYERS[fam]
        t = time.perf_counter()
        results[fam] = measure(fam, tok, args)
        results[fam]["wall_s"] = time.perf_counter() - t
        r = results[fam]
        print(f"{NAMES[fam]}: done in {r['wall_s']:.0f} s: " + ", ".join(
            f"{k} {v:.2f}" for k, v in r.items() if isinstance(v, float)), flush=True)
        write_json(args.json, results)  # each shape as soon as it is measured: a cut-short run keeps it
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
    write_json(args.json, results)
    return results


def first_request(args) -> dict:
    """``--mode ready``, ``loop`` or ``first-request`` (both): each measured in fresh processes."""
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --dry-run)")
    models = args.models
    results: dict = {"date": time.strftime("%Y-%m-%d"), "smoke": args.dry_run,
                     "device": "cpu" if args.dry_run else torch.cuda.get_device_name(), "ready": [], "loop": None}
    with tempfile.TemporaryDirectory(prefix="lazyllm-triton-") as tmp:
        if args.mode in ("ready", "first-request"):
            for fam in models:
                cache = os.path.join(tmp, fam)  # empty for the first process, warm for the second
                for label in ("empty", "warm"):
                    r = _spawn(args, ["--child", f"ready:{fam}"], cache)
                    r["cache"] = label
                    results["ready"].append(r)
                    print(f"{fam} ({label} Triton cache): ready in {r['ready_s']:.1f} s, "
                          f"process {r['process_s']:.0f} s", flush=True)
            _print_ready(results["ready"])
        if args.mode in ("loop", "first-request"):
            results["loop"] = _spawn(args, ["--child", "loop"], os.path.join(tmp, "loop"))
            _print_loop(results["loop"])
    write_json(args.json, results)
    return results




def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="figures", choices=("figures", "ready", "loop", "first-request"),
                    help="figures: each shape's engine figures; ready: time to ready and the first request; "
                         "loop: the first closed-loop pass against the next; first-request: ready and loop")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--layers", type=int, default=None, help="figures: layers per model (default: the real count)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--steps", type=int, default=32, help="figures: decode steps per request")
    ap.add_argument("--kv-gb", type=int, default=None, help="KV pool size in GiB (default 24; 1 with --dry-run)")
    ap.add_argument("--dry-run", "--smoke", dest="dry_run", action="store_true",
                    help="CPU, float32, tiny shapes, short prompts, small batches and loop: checks that it runs")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # ready:<model> or loop
    args = ap.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if not args.models or any(m not in MODELS for m in args.models):
        ap.error(f"--models takes a subset of {','.join(MODELS)}")
    args.kv_gb = args.kv_gb or (1 if args.dry_run else 24)
    args.dry_run = args.dry_run
    args.docs, args.doc_tokens, args.k, args.requests, args.output_tokens, args.alpha = \
        (12, 48, 3, 16, 4, 2.1) if args.dry_run else (100, 1024, 5, 128, 32, 2.1)
    return args


def main(argv=None) -> dict:
    args = _args(argv)
    if args.child:  # a measuring process of --mode ready / loop
        kind, _, fam = args.child.partition(":")
        res = child_ready(fam, args) if kind == "ready" else child_loop(args)
        print(TAG + json.dumps(res, default=str), flush=True)
        return res
    return figures(args) if args.mode == "figures" else first_request(args)


if __name__ == "__main__":
    main()
