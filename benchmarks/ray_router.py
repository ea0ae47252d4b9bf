"""Replicas on Ray Serve: per-document affinity (``DocumentAffinityRouter``) against Ray
Serve's default router (power of two choices) and its ``PrefixCacheAffinityRouter``, on the
skewed RAG workload of ``rag_serving.py`` (its document and request generators: Zipf over
document ranks, ``--k`` distinct documents per request in random order).

Per (router, alpha) a fresh application of ``--replicas`` replicas is deployed (empty
caches), serves ``--warm-requests`` requests of the warm-up stream, then the measured
``--requests`` in a closed loop of ``--concurrency`` clients. Each replica's KV pool holds
``--budget`` of the document pool's KV (default: 1 / replicas, so that the replicas together
could hold every document once: what affinity can exploit and a router that scatters
documents cannot).

Metrics: chunk hit rate (chunk tokens served from a replica's cache / chunk tokens asked
for), req/s over the wall time, TTFT p50/p95 measured by the client (first streamed delta,
routing and queueing included), and how the requests spread over the replicas.

``--fault``: a replica killed under load. The document router serves a closed loop; after
``--kill-after`` seconds one replica actor is killed with ``ray.kill``; every request must
complete or fail with an error within ``--request-timeout`` (none hangs); Ray Serve's
controller starts a replacement.

    python benchmarks/ray_router.py                      # 4 replicas, alpha 1.1 and 2.1, 3 routers
    python benchmarks/ray_router.py --fault --replicas 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

# siblings are loaded by path (see rag_serving.py on why benchmarks/ is not on sys.path)


def _sibling(name: str):
    import importlib.util
    import sys

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_lazyllm_bench_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


rag = _sibling("rag_serving")


def run_stream(handle, req, timeout_s):
    """One request through the streaming handle: client TTFT and the replica's result."""
    t0 = time.perf_counter()
    ttft, done = None, None
    gen = handle.options(stream=True).stream.remote(req)
    for part in gen:
        if ttft is None:
            ttft = time.perf_counter() - t0
        if "done" in part:
            done = part["done"]
        if time.perf_counter() - t0 > timeout_s:
            gen.cancel()
            raise TimeoutError(f"request took over {timeout_s} s")
    return dict(ttft=ttft, engine_ttft=done["ttft_s"], replica=done["replica"], chunk=done["chunk_tokens"],
                cached_chunk=done["cached_chunk_tokens"], out=done["completion_tokens"])


def router_decisions(handle) -> dict | None:
    """How often the document router chose by affinity, by owner, or fell back (warm-up
    included); read from the handle's router in this process (Ray internals: best effort)."""
    try:
        return dict(handle._router._asyncio_router.request_router.decisions)
    except AttributeError:
        return None


def deploy(args, router: str, kv_bytes: int, name: str):
    from ray import serve

    from lazyllm.integrations.ray_serve import build_app

    app = build_app(None, num_replicas=args.replicas, num_cpus=0, router=router, name=name,
                    max_ongoing_requests=args.max_ongoing, stats_period_s=args.stats_period,
                    imbalanced_threshold=args.imbalanced_threshold, torch_threads=1,
                    kv_cache_bytes=kv_bytes)
    return serve.run(app, name=name, route_prefix=None)


def point(args, router, alpha, docs, warm_reqs, reqs, kv_bytes):
    from ray import serve

    from lazyllm.integrations.ray_serve import ServeRequest

    name = f"bench-{router}-{alpha:g}".replace(".", "_")
    t = time.perf_counter()
    handle = deploy(args, router, kv_bytes, name)
    time.sleep(2 * args.stats_period)
    startup = time.perf_counter() - t

    def one(r):
        sr = ServeRequest(r.question, [docs[i] for i in r.doc_ids],
                          sampling={"max_new_tokens": args.output_tokens})
        return run_stream(handle, sr, args.request_timeout)

    t = time.perf_counter()
    rag.drive(one, warm_reqs, 0.0, args.concurrency, 0)
    warm_s = time.perf_counter() - t
    res, wall = rag.drive(one, reqs, 0.0, args.concurrency, 0)
    decisions = router_decisions(handle)
    serve.delete(name)
    ok = [x for x, _ in res if "error" not in x]
    failed = [x for x, _ in res if "error" in x]
    per_replica: dict = {}
    for x in ok:
        per_replica[x["replica"]] = per_replica.get(x["replica"], 0) + 1
    chunk, cached = sum(x["chunk"] for x in ok), sum(x["cached_chunk"] for x in ok)
    row = dict(router=router, alpha=alpha, requests=len(ok), failed=len(failed), wall_s=wall,
               req_per_s=len(ok) / wall, hit_rate=cached / max(chunk, 1), chunk_tokens=chunk,
               cached_chunk_tokens=cached,
               ttft_p50_ms=statistics.median(x["ttft"] for x in ok) * 1e3 if ok else float("nan"),
               ttft_p95_ms=rag.pct([x["ttft"] for x in ok], 0.95) * 1e3 if ok else float("nan"),
               engine_ttft_p50_ms=statistics.median(x["engine_ttft"] for x in ok) * 1e3 if ok else float("nan"),
               spread=sorted(per_replica.values(), reverse=True), startup_s=startup, warm_s=warm_s,
               decisions=decisions)
    if failed:
        row["error"] = failed[0]["error"]
    return row


def fault(args, docs, reqs, kv_bytes):
    """A replica killed under load: every request completes or fails clearly, none hangs."""
    import ray
    from ray import serve

    from lazyllm.integrations.ray_serve import ServeRequest

    name = "bench-fault"
    handle = deploy(args, "documents", kv_bytes, name)
    time.sleep(2 * args.stats_period)
    killed: dict = {}

    def killer():
        time.sleep(args.kill_after)
        replicas = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("SERVE_REPLICA::") and name in a["name"]]
        victim = replicas[0]
        killed.update(name=victim["name"], at=time.perf_counter() - t0)
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)

    def one(r):
        t = time.perf_counter()
        try:
            out = run_stream(handle, ServeRequest(r.question, [docs[i] for i in r.doc_ids],
                                                  sampling={"max_new_tokens": args.output_tokens}),
                             args.request_timeout)
            return dict(ok=True, s=time.perf_counter() - t, replica=out["replica"])
        except Exception as e:  # the point: what a caller sees
            return dict(ok=False, s=time.perf_counter() - t, error=f"{type(e).__name__}: {str(e)[:160]}")

    t0 = time.perf_counter()
    th = threading.Thread(target=killer)
    th.start()
    res, wall = rag.drive(one, reqs, 0.0, args.concurrency, 0)
    th.join()
    # the controller replaces the dead replica
    t = time.perf_counter()
    while time.perf_counter() - t < 120:
        st = serve.status().applications[name].deployments[name]
        running = st.replica_states.get("RUNNING", 0)
        if running >= args.replicas:
            break
        time.sleep(1)
    recovered = time.perf_counter() - t0
    after = handle.generate.remote(ServeRequest("Still there?", [docs[0]], sampling={"max_new_tokens": 2})).result(
        timeout_s=args.request_timeout)
    serve.delete(name)
    xs = [x for x, _ in res]
    errors: dict = {}
    for x in xs:
        if not x["ok"]:
            key = x["error"].split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    print(f"\nFault test: {len(xs)} requests, {args.replicas} replicas, closed loop of {args.concurrency}; "
          f"killed {killed.get('name')} at {killed.get('at', float('nan')):.1f} s")
    print(f"- completed: {sum(x['ok'] for x in xs)}, failed with an error: {sum(not x['ok'] for x in xs)} {errors}, "
          f"hung (over {args.request_timeout:g} s): {sum(x['s'] >= args.request_timeout for x in xs)}")
    print(f"- slowest request {max(x['s'] for x in xs):.1f} s; replicas back to {args.replicas} RUNNING at "
          f"{recovered:.1f} s; a request after recovery served by {after['replica']}")
    for x in xs:
        if not x["ok"]:
            print(f"  error after {x['s']:.1f} s: {x['error']}")
            break
    return dict(requests=len(xs), completed=sum(x["ok"] for x in xs), failed=errors, killed=killed,
                recovered_s=recovered, wall_s=wall)


def plot(rows, out_dir, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    routers = list(dict.fromkeys(r["router"] for r in rows))
    alphas = sorted({r["alpha"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, label) in zip(axes, [("hit_rate", "chunk hit rate"), ("req_per_s", "req/s (closed loop)"),
                                       ("ttft_p50_ms", "TTFT p50 (ms, client)")]):
        w = 0.8 / len(routers)
        for i, router in enumerate(routers):
            ys = [next((r[key] for r in rows if r["router"] == router and r["alpha"] == a), 0) for a in alphas]
            ax.bar([j + i * w for j in range(len(alphas))], ys, w, label=router, color=f"C{i}")
        ax.set_xticks([j + w * (len(routers) - 1) / 2 for j in range(len(alphas))])
        ax.set_xticklabels([f"alpha {a:g}" for a in alphas])
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, "router_comparison.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--routers", default="documents,default,prefix")
    ap.add_argument("--alphas", default="1.1,2.1")
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--doc-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--warm-requests", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-ongoing", type=int, default=8, help="max_ongoing_requests per replica")
    ap.add_argument("--budget", type=float, default=None,
                    help="KV pool per replica as a fraction of the document pool (default 1 / replicas)")
    ap.add_argument("--stats-period", type=float, default=1.0, help="request_routing_stats_period_s")
    ap.add_argument("--imbalanced-threshold", type=float, default=4)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--fault", action="store_true", help="kill a replica under load instead")
    ap.add_argument("--kill-after", type=float, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plots", default=None, help="folder for router_comparison.png")
    args = ap.parse_args(argv)
    import ray
    import torch
    from ray import serve
    from transformers import AutoConfig, AutoTokenizer

    from lazyllm.model.loader import default_model_dir

    t_start = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    cfg = AutoConfig.from_pretrained(str(default_model_dir()))
    docs = rag.make_docs(tok, args)
    pool = args.docs * (args.doc_tokens + 2) * rag.kv_bytes_per_token(cfg, torch.float32)
    budget = args.budget if args.budget is not None else 1.0 / args.replicas
    page = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    # room for the running requests' private pages (prefix, question, decode) on top
    kv_bytes = int(budget * pool) + args.max_ongoing * 12 * page
    alphas = [float(a) for a in args.alphas.split(",")]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}})
    serve.start(proxy_location="Disabled")
    rows: list = []
    try:
        if args.fault:
            reqs = rag.make_requests(tok, args, alphas[0], "fault", args.requests)
            out = fault(args, docs, reqs, kv_bytes)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "fault": out}, f, indent=2)
            return out
        for a in alphas:
            warm_reqs = rag.make_requests(tok, args, a, "warm", args.warm_requests)
            reqs = rag.make_requests(tok, args, a, "rate0", args.requests)
            for router in args.routers.split(","):
                row = point(args, router, a, docs, warm_reqs, reqs, kv_bytes)
                rows.append(row)
                if args.json:  # after every point: a run cut short keeps its figures
                    with open(args.json, "w") as f:
                        json.dump({"args": vars(args), "rows": rows}, f, indent=2)
                print(f"  {router:9s} alpha={a:g}: hit rate {row['hit_rate']:.2f}, {row['req_per_s']:.2f} req/s, "
                      f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, spread {row['spread']}, failed {row['failed']}, "
                      f"decisions {row['decisions']} "
                      f"(start {row['startup_s']:.0f} s, warm-up {row['warm_s']:.0f} s, "
                      f"measured {row['wall_s']:.0f} s)",
                      flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    title = (f"{args.replicas} replicas of SmolLM2-135M on a {os.cpu_count()}-core CPU, {args.docs} docs x "
             f"{args.doc_tokens} tokens, k={args.k}, KV per replica {budget:.2f} of the documents, "
             f"{time.strftime('%Y-%m-%d')}")
    print(f"\nRouters, {title}; {args.requests} requests per point after {args.warm_requests} warm-up, closed loop "
          f"of {args.concurrency}, {args.output_tokens} output tokens, {time.perf_counter() - t_start:.0f} s in all")
    print("| router | alpha | done/failed | chunk hit rate | req/s | TTFT p50 ms | TTFT p95 ms | engine TTFT p50 ms "
          "| requests per replica |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['router']} | {r['alpha']:g} | {r['requests']}/{r['failed']} | {r['hit_rate']:.2f} | "
              f"{r['req_per_s']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | "
              f"{r['engine_ttft_p50_ms']:.0f} | {r['spread']} |")
    print("\nDocument affinity against each baseline (>1 favours affinity):")
    for a in alphas:
        mine = next((r for r in rows if r["router"] == "documents" and r["alpha"] == a), None)
        for base in [r for r in rows if r["alpha"] == a and r["router"] != "documents"]:
            if mine:
                hit = rag._ratio(mine["hit_rate"], base["hit_rate"])
                print(f"- alpha {a:g} vs {base['router']}: hit rate {hit:.2f}x,"
                      f" throughput {rag._ratio(mine['req_per_s'], base['req_per_s']):.2f}x, TTFT p50 "
                      f"{rag._ratio(base['ttft_p50_ms'], mine['ttft_p50_ms']):.2f}x lower")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "title": title, "rows": rows}, f, indent=2)
    if args.plots:
        print("plot:", plot(rows, args.plots, title))
    return rows


if __name__ == "__main__":
    main()
