"""Skewed RAG serving: LazyAttention (`lazy`) against Block-Attention (`block`), identical-
prefix caching (`prefix`), no reuse (`none`) and transformers `generate` on the flattened
prompt (`hf`, what LangChain's HuggingFacePipeline and LlamaIndex's HuggingFaceLLM do), all
on the same model and device, with the same seeded requests.

Workload: a pool of ``--docs`` documents of ``--doc-tokens`` tokens; each request retrieves
``--k`` distinct documents drawn from a Zipf distribution of exponent ``alpha`` over document
ranks (``alpha 0`` is uniform), in random order, with a 32-64 token question and a fixed
number of output tokens (EOS is ignored, so every system does the same work).

Arrivals: ``--rates`` in requests/s. A rate ``r > 0`` is a Poisson process (exponential
gaps) rescaled so that the last of the N requests arrives exactly at ``N / r``: a short run
then offers exactly its nominal rate. Rate ``0`` is a closed loop at ``--concurrency`` (each
client sends its next request when the last one finished): the saturation throughput.
``--rates`` and ``--budgets`` may differ per alpha: ``"2.1=2,4,8;0=1,2"``, and rates per
(alpha, budget): ``"2.1=2,4,8;0=1,2;2.1@0.12=0"``.

Measurement. Per system and KV budget one engine is built; per alpha it first serves
``--warm-requests`` requests of a separate warm-up stream (same documents and distribution)
at ``--warm-concurrency``, so that Triton compiles, CUDA-graph captures and the filling of the
cache happen before measuring. Each (alpha, rate) point then serves its own N requests
(seeded by seed, alpha and rate: every system sees the same ones) starting from the cache the
previous point left: the steady state of a server that runs this workload (``--cold`` clears
the cache before each point instead, counting every first use as a miss).

Metrics per point: TTFT p50/p95 (``ttft_s``: from the call to the first token),
TPOT (median), req/s and output tok/s over the wall time
(start to last completion), finish rate (completions per second: 1 / the least-squares slope
of the sorted completion times against their rank; the service rate, insensitive to the
latency of the first and last requests), **chunk hit rate** (chunk tokens served
from the cache / chunk tokens requested; the system prefix and the question are excluded, as
the prefix is always a hit and the question never is), prompt hit rate (cached prompt tokens /
prompt tokens, the prefix included), prefilled tokens, peak KV pool use, pages copied
re-rotated (block), evictions, preemptions, and for the engine's systems the point's **floor**
(``benchmarks/_common.py``'s ``floor``: its prefilled tokens at the dense per-token time plus its decode steps
at the weight-read time, both measured on the same engine in the same run), the point's
fraction of it, and where the rest of the wall went (prefill, decode, selection, host).

A system **sustains** a Poisson rate ``r`` when (1) every request completed, (2) its finish
rate is at least 90% of ``r`` (a stable queue drains as fast as it fills; an overloaded one
completes at its capacity, below ``r``) and (3) its TTFT p95 is at most ``--sustain-p95-factor``
(default 3) times its own TTFT p95 at the lowest rate of the same alpha and budget (the tail
does not explode as the queue builds up). The summary gives, per (alpha, budget): the highest
rate each of lazy and block sustains (with every lower swept rate sustained too); at block's
highest sustained rate, the lazy/block ratios of TTFT p50 (block / lazy) and of req/s (both
complete about what is offered there, so this one is about 1 by construction); the
sustained-throughput ratio (lazy's finish rate at its highest sustained rate / block's at its
own); the closed-loop (saturation) throughput and TTFT ratios; the chunk hit-rate ratio
lazy / block (pooled over the points). Per alpha with `hf`
rows: lazy against `hf` at the same rate (the largest budget lazy ran).

    # CPU, default model, small (what CI runs):
    python benchmarks/rag_serving.py --preset ci
    # H200, Llama-3.1-8B shapes with random bf16 weights: see benchmarks/gpu_run.sh serving

The workload and the figures' code: ``benchmarks/serving/`` (modules, not commands).
"""
from __future__ import annotations

import argparse
import gc
import json
import threading
import time

import torch
from _common import floor, floor_line, llama31_8b_config, measure_rates, random_model, run_to_length

from benchmarks.serving.report import (  # noqa: F401  (tests and sibling tools reach them through this module)
    engine_profile,
    finish_rate,
    mark_sustained,
    pct,
    plot,
    print_summary,
    print_table,
    summarize,
    summarize_point,
)
from benchmarks.serving.workload import (  # noqa: F401
    Req,
    arrivals,
    cached_chunk_tokens_of_prefix,
    chunk_tokens_of,
    drive,
    make_docs,
    make_requests,
    make_text,
    zipf_sample,
)

PRESETS = {
    "ci": dict(docs=12, doc_tokens=48, k=2, requests=6, output_tokens=3, budgets="0.6,1.0", rates="0",
               concurrency=2, alphas="2.1", systems="lazy,block,prefix,none,hf", warm_requests=2),
    # what benchmarks/gpu_run.sh serving runs
    "h200": dict(docs=100, doc_tokens=2048, k=5, requests=32, output_tokens=16, budgets="2.1=0.33,0.2,0.12;0=0.33",
                 rates="2.1=0,3,5,7,10,14;0=0,1.5,3;2.1@0.12=0", hf_rates="2.1=0;0=", concurrency=16,
                 alphas="2.1,0", systems="lazy,block,hf", random_8b=True, warm_requests=32, warm_concurrency=32,
                 deadline_s=420.0),
}
class HFServer:
    """transformers ``generate`` on the flattened prompt, one request at a time (FIFO),
    the way an in-process HuggingFacePipeline serves a chain."""

    def __init__(self, model, tok, prompts):
        from transformers.generation.streamers import BaseStreamer

        self.model, self.tok, self.prompts, self.lock = model, tok, prompts, threading.Lock()
        self.BaseStreamer = BaseStreamer

    def run(self, question, chunks, max_new_tokens):
        from lazyllm import Chunk

        segs = self.prompts.build(question, [Chunk(c) for c in chunks], None)
        ids = [t for s in segs for t in s.ids]
        n_chunk = sum(len(s.ids) for s in segs if s.kind == "chunk")
        submit = time.perf_counter()
        stamps = []

        class Stamp(self.BaseStreamer):
            def put(self, value):
                stamps.append(time.perf_counter())

            def end(self):
                pass

        dev = next(self.model.parameters()).device
        with self.lock, torch.inference_mode():
            out = self.model.generate(torch.tensor([ids], device=dev), do_sample=False,
                                      max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                      streamer=Stamp(), pad_token_id=0,
                                      attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev))
        end = time.perf_counter()
        n = out.shape[1] - len(ids)
        ttft = (stamps[1] if len(stamps) > 1 else end) - submit  # stamps[0] is the prompt
        return dict(ttft=ttft, tpot=(end - submit - ttft) / max(n - 1, 1), out=n, prompt=len(ids),
                    cached=0, chunk=n_chunk, cached_chunk=0)


def kv_bytes_per_token(cfg, dtype) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kvh * head_dim * torch.empty((), dtype=dtype).element_size()


class LazyRunner:
    """One engine (system, budget), reused across alphas and rates."""

    def __init__(self, system, hf, tok, args, budget_frac, pool_bytes):
        from lazyllm import LazyLLM
        from lazyllm.kernels.options import KernelOptions

        self.system, self.args, self.budget = system, args, budget_frac
        # packets=None: the budgets are fractions of the corpus's own tokens and the systems are
        # compared as they reuse KV; a learned packet (shipped for the default model) would add
        # its tokens to every chunk of lazy and block only
        # `balanced`: lazy reuse with the balanced fidelity preset (selective recompute); a
        # `+mixed` variant (`lazy+mixed`) runs the same system with mixed steps on
        base, _, variant = system.partition("+")
        if variant not in ("", "mixed"):
            raise SystemExit(f"unknown system variant {system!r} (known: +mixed)")
        self.base = base
        # the reuse modes as they are (quality="isolated": nothing recomputed), or balanced's recompute
        kw = dict(quality="balanced") if base == "balanced" else dict(quality="isolated", reuse=base)
        if variant == "mixed":
            kw.update(mixed_steps=True, step_token_budget=args.step_token_budget)
        self.llm = LazyLLM(model=hf, tokenizer=tok, packets=None, warmup=args.warmup, **kw,
                           kv_cache_bytes=max(int(budget_frac * pool_bytes), 1 << 20), page_size=args.page_size,
                           kernel_options=KernelOptions(shared_decode=args.shared_decode))
        run_to_length(self.llm)  # every request runs to its length: same work for every system
        # the floor's rates, measured on this engine (two fresh chunks, dropped again)
        self.rates = measure_rates(self.llm, min(args.doc_tokens, 1024))
        self.llm.clear_cache()
        print(f"  {system}: {self.rates.line()}", flush=True)
        self.page_bytes = pool_bytes / max(args.docs * args.doc_tokens, 1) * self.llm.page_size

    def one(self, r, docs):
        from lazyllm import LazyLLMError

        try:
            out = self.llm.generate(r.question, chunks=[docs[i] for i in r.doc_ids],
                                    max_new_tokens=self.args.output_tokens)
        except LazyLLMError as e:  # e.g. a budget too small for this system: reported, not fatal
            return dict(error=str(e))
        segs = out.prompt_segments
        if self.base in ("lazy", "block", "balanced"):
            cached_chunk = out.usage.cached_chunk_tokens
        else:
            cached_chunk = cached_chunk_tokens_of_prefix(segs, out.usage.cached_tokens)
        return dict(ttft=out.ttft_s, tpot=out.tpot_s, out=out.usage.completion_tokens,
                    prompt=out.usage.prompt_tokens, cached=out.usage.cached_tokens, chunk=chunk_tokens_of(segs),
                    cached_chunk=cached_chunk)

    def warm(self, reqs, docs):
        """Compiles, graph captures and a filled cache, before measuring."""
        drive(lambda r: self.one(r, docs), reqs, 0.0, self.args.warm_concurrency, 0)

    def measure(self, reqs, docs, rate, alpha):
        a, llm = self.args, self.llm
        if a.cold:
            llm.clear_cache()
        m, c = llm.engine.metrics, llm.store.counters
        m0, c0 = dict(m), dict(c.__dict__)
        g0 = llm.engine.graph_stats()
        m.peak_pages = 0
        res, wall = drive(lambda r: self.one(r, docs), reqs, rate, a.concurrency, f"{a.seed}/{alpha}/{rate}")
        g1 = llm.engine.graph_stats()
        lookups = (c.hits - c0["hits"]) + (c.misses - c0["misses"])
        extra = dict(prefill_tokens=m["prefill_tokens"] - m0["prefill_tokens"],
                     peak_kv_gib=m["peak_pages"] * self.page_bytes / 2**30,
                     copied_gib=(m.get("copied_pages", 0) - m0.get("copied_pages", 0)) * self.page_bytes / 2**30,
                     evictions=c.evictions - c0["evictions"], preemptions=m["preemptions"] - m0["preemptions"],
                     # CUDA graphs captured during the point, and the seconds requests waited for them
                     graph_captures=sum(g1[k] - g0[k] for k in ("decode_graphs", "prefill_graphs")),
                     capture_s=g1["capture_s"] - g0["capture_s"],
                     # cache_stats' rate over segment lookups (the prefix included), as earlier runs
                     # reported it (then inflated: each re-planning of a waiting request counted)
                     store_lookup_hit_rate=(c.hits - c0["hits"]) / max(lookups, 1))
        extra["profile"] = engine_profile(m0, m, wall)
        extra["floor"] = floor(self.rates, m0, dict(m), wall)
        print(f"  {self.system} alpha={alpha:g} rate={rate:g}: " +
              ", ".join(f"{k} {v:.3g}" for k, v in extra["profile"].items()), flush=True)
        print(f"  {self.system} alpha={alpha:g} rate={rate:g}: {floor_line(extra['floor'])}", flush=True)
        return summarize_point(self.system, self.budget, rate, alpha, res, wall, extra)

    def close(self):
        self.llm.close()
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def per_alpha(spec: str, alphas: list[float]) -> dict:
    """``"1,2"`` (every alpha) or ``"2.1=1,2;0=3"`` -> {alpha: [values]}; a key
    ``alpha@budget`` (``"2.1@0.12=0"``) overrides the alpha's values at that budget, under
    the key ``(alpha, budget)``."""
    if "=" not in spec:
        vals = [float(v) for v in spec.split(",") if v.strip()]
        return {a: vals for a in alphas}
    out: dict = {}
    for part in spec.split(";"):
        if part.strip():
            key, vals = part.split("=")
            k = tuple(float(x) for x in key.split("@")) if "@" in key else float(key)
            out[k] = [float(v) for v in vals.split(",") if v.strip()]
    missing = [a for a in alphas if a not in out]
    if missing:
        raise SystemExit(f"no values given for alpha {missing} in {spec!r}")
    return out


class Run:
    """One run's rows, its skipped points and its clock: ``save`` rewrites the JSON after every
    point (a run cut short still leaves its figures); ``late`` adds points to the skipped ones
    once ``--deadline-s`` has passed."""

    def __init__(self, args, name: str):
        self.args, self.name, self.rows, self.skipped = args, name, [], []
        self.t_start = time.perf_counter()
        self.dev_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"

    def save(self, final: bool = False) -> None:
        if not self.args.json:
            return
        rows = self.rows if final else [dict(r) for r in self.rows]
        if not final:
            mark_sustained(rows, self.args.sustain_p95_factor)
        out = {"args": vars(self.args), "device": self.dev_name, "model": self.name, "rows": rows,
               "summary": summarize(rows)}
        if final:
            out["skipped"] = self.skipped
        with open(self.args.json, "w") as f:
            json.dump(out, f, indent=2)

    def late(self, what: list) -> bool:
        if self.args.deadline_s is not None and time.perf_counter() - self.t_start > self.args.deadline_s:
            self.skipped.extend(what)
            return True
        return False


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    ap.add_argument("--random-8b", action="store_true", help="random bf16 weights in Llama-3.1-8B shapes (GPU)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer folder for --random-8b (default: the default model's; to carry one to a GPU "
                         "machine: python benchmarks/engine.py --save-tokenizer DIR)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--alphas", default="2.1")
    ap.add_argument("--requests", type=int, default=64, help="requests per measured point")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--rates", default="0",
                    help="Poisson rates in requests/s, 0 = closed loop; per alpha: '2.1=2,4;0=1'")
    ap.add_argument("--hf-rates", default=None, help="the rates at which hf runs (default: every rate)")
    ap.add_argument("--concurrency", type=int, default=8, help="clients of the closed loop")
    ap.add_argument("--budgets", default="0.2,0.33,1.0",
                    help="KV budget as a fraction of the document pool's KV; per alpha: '2.1=0.2,0.33;0=0.33'")
    ap.add_argument("--systems", default="lazy,block,prefix,none,hf",
                    help="comma-separated: lazy, block, prefix, none (the engine's reuse modes), balanced "
                         "(lazy with quality='balanced'), hf (transformers generate); an engine system with "
                         "'+mixed' (lazy+mixed, balanced+mixed) runs with mixed_steps=True")
    ap.add_argument("--step-token-budget", type=int, default=2048,
                    help="tokens per mixed step of the '+mixed' systems (LazyLLM(step_token_budget=...))")
    ap.add_argument("--warm-requests", type=int, default=None, help="warm-up requests per alpha (2 x concurrency)")
    ap.add_argument("--warm-concurrency", type=int, default=None, help="(default: --concurrency)")
    ap.add_argument("--cold", action="store_true", help="clear the cache before each measured point")
    ap.add_argument("--sustain-p95-factor", type=float, default=3.0)
    ap.add_argument("--page-size", type=int, default=None, help="default: the engine's (64 on CUDA, 16 on CPU)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no new point after this many seconds (the skipped ones are listed)")
    ap.add_argument("--shared-decode", action=argparse.BooleanOptionalAction, default=True,
                    help="shared-chunk decode where requests of a step hold the same pages (the engine's default); "
                         "--no-shared-decode: the per-request kernel only")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="LazyLLM(warmup=...): compile and capture everything at construction (the measured "
                         "points follow the warm-up stream either way)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plots", default=None, help="folder for PNG plots")
    args = ap.parse_args(argv)
    if args.preset:
        defaults = ap.parse_args([])
        for key, val in PRESETS[args.preset].items():
            if getattr(args, key) == getattr(defaults, key, None):
                setattr(args, key, val)
    if args.warm_requests is None:
        args.warm_requests = 2 * args.concurrency
    if args.warm_concurrency is None:
        args.warm_concurrency = args.concurrency
    return args


def _model(args):
    """``(transformers model, tokenizer, name)``: random Llama-3.1-8B shapes or a real model."""
    from transformers import AutoTokenizer

    from lazyllm.model.loader import default_model_dir, load_hf

    if args.random_8b:
        hf = random_model(llama31_8b_config(32))
        tok = AutoTokenizer.from_pretrained(args.tokenizer or str(default_model_dir()))
        name = "random Llama-3.1-8B shapes, bf16"
    else:
        dev = "cuda" if args.device == "auto" and torch.cuda.is_available() else ("cpu" if args.device == "auto"
                                                                                  else args.device)
        hf, tok, name = load_hf(args.model, device=dev, dtype=torch.bfloat16 if dev.startswith("cuda")
                                else torch.float32)
    return hf, tok, name


def _engine_points(run: Run, hf, tok, docs, work) -> None:
    """Every engine system's points, budget-major (lazy and block of one budget back to back)."""
    args = run.args
    alphas, rates, budgets, points, warm, pool_bytes = work
    budget_order = list(dict.fromkeys(b for a in alphas for b in budgets[a]))  # as given: most wanted first
    for b in budget_order:
        for system in [s for s in args.systems.split(",") if s != "hf"]:
            todo = [(a, r) for a in alphas if b in budgets[a] for r in rates.get((a, b), rates[a])]
            if run.late([f"{system} alpha={a:g} budget={b} rate={r:g}" for a, r in todo]):
                continue
            runner = LazyRunner(system, hf, tok, args, b, pool_bytes)
            try:
                for a in alphas:
                    if b not in budgets[a]:
                        continue
                    mine = rates.get((a, b), rates[a])
                    if run.late([f"{system} alpha={a:g} budget={b} rate={r:g}" for r in mine]):
                        continue
                    t = time.perf_counter()
                    runner.warm(warm[a], docs)
                    print(f"  {system:6s} alpha={a:g} budget={b}: warm-up {time.perf_counter() - t:.1f} s", flush=True)
                    for rate in mine:
                        if run.late([f"{system} alpha={a:g} budget={b} rate={rate:g}"]):
                            continue
                        t = time.perf_counter()
                        row = runner.measure(points[(a, rate)], docs, rate, a)
                        run.rows.append(row)
                        run.save()
                        print(f"  {system:6s} alpha={a:g} budget={b} rate={rate:g}: ttft p50 {row['ttft_p50_ms']:.1f} "
                              f"ms, {row['req_per_s']:.2f} req/s, chunk hit rate {row['hit_rate']:.2f} "
                              f"({time.perf_counter() - t:.1f} s)", flush=True)
            finally:
                runner.close()


def _hf_points(run: Run, hf, tok, docs, hf_todo, points, warm_first) -> None:
    """transformers ``generate`` at each of its points."""
    from lazyllm.inputs import PromptBuilder

    args = run.args
    server = HFServer(hf, tok, PromptBuilder(tok))
    server.run(warm_first.question, [docs[i] for i in warm_first.doc_ids], 2)  # warm-up
    for a, rate in hf_todo:
        if run.late([f"hf alpha={a:g} rate={rate:g}"]):
            continue
        t = time.perf_counter()
        res, wall = drive(lambda r: server.run(r.question, [docs[i] for i in r.doc_ids], args.output_tokens),
                          points[(a, rate)], rate, args.concurrency, f"{args.seed}/{a}/{rate}")
        extra = dict(prefill_tokens=sum(x["prompt"] for x, _ in res if "error" not in x),
                     peak_kv_gib=float("nan"), copied_gib=float("nan"), evictions=0, preemptions=0,
                     store_lookup_hit_rate=0.0)
        row = summarize_point("hf", 1.0, rate, a, res, wall, extra)
        run.rows.append(row)
        run.save()
        print(f"  hf     alpha={a:g} rate={rate:g}: ttft p50 {row['ttft_p50_ms']:.1f} ms, "
              f"{row['req_per_s']:.2f} req/s ({time.perf_counter() - t:.1f} s)", flush=True)


def main(argv=None):
    args = _args(argv)
    run = Run(args, "")  # its clock (and --deadline-s) counts from here, the model's load included
    hf, tok, name = _model(args)
    run.name = name
    alphas = [float(a) for a in args.alphas.split(",")]
    rates, budgets = per_alpha(args.rates, alphas), per_alpha(args.budgets, alphas)
    hf_rates = per_alpha(args.hf_rates, alphas) if args.hf_rates is not None else rates
    docs = make_docs(tok, args)
    points = {}
    for key, rs in list(rates.items()) + list(hf_rates.items()):
        a = key[0] if isinstance(key, tuple) else key
        if a in alphas:
            for r in rs:
                points.setdefault((a, r), make_requests(tok, args, a, f"rate{r:g}", args.requests))
    warm = {a: make_requests(tok, args, a, "warm", args.warm_requests) for a in alphas}
    print(f"model and workload ready in {time.perf_counter() - run.t_start:.1f} s", flush=True)
    pool_bytes = args.docs * args.doc_tokens * kv_bytes_per_token(hf.config, next(hf.parameters()).dtype)
    _engine_points(run, hf, tok, docs, (alphas, rates, budgets, points, warm, pool_bytes))
    hf_todo = [(a, r) for a in alphas for r in hf_rates[a]]
    if "hf" in args.systems.split(",") and hf_todo and not run.late([f"hf alpha={a:g} rate={r:g}"
                                                                      for a, r in hf_todo]):
        _hf_points(run, hf, tok, docs, hf_todo, points, warm[alphas[0]][0])
    rows = run.rows
    mark_sustained(rows, args.sustain_p95_factor)
    summary = summarize(rows)
    print(f"\nRAG serving, {name} on {run.dev_name}, {args.docs} docs x {args.doc_tokens} tokens, k={args.k}, "
          f"{args.requests} requests per point, {args.output_tokens} output tokens, "
          f"{'cold' if args.cold else 'steady-state'} cache, {time.strftime('%Y-%m-%d')}, "
          f"{time.perf_counter() - run.t_start:.0f} s in all")
    print_table(rows)
    print_summary(summary)
    if run.skipped:
        print(f"\nSkipped (past --deadline-s {args.deadline_s:g}): " + "; ".join(run.skipped))
    run.save(final=True)
    if args.plots:
        plot(rows, args.plots)
    return rows, summary

if __name__ == "__main__":
    main()
