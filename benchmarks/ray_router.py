"""Replicas on Ray Serve: per-document affinity (``DocumentAffinityRouter``) against Ray
Serve's default router (power of two choices) and its ``PrefixCacheAffinityRouter``, on the
skewed RAG workload of ``rag_serving.py`` (its document and request generators: Zipf over
document ranks, ``--k`` distinct documents per request in random order).

Per (router, alpha) a fresh application of ``--replicas`` replicas is deployed (empty
caches), serves ``--warm-requests`` requests of the warm-up stream, then the measured
``--requests``, in a closed loop of ``--concurrency`` clients (default one per replica:
below the load at which the document router falls back to power of two choices) or, with
``--rate``, Poisson arrivals at that rate. Each replica's KV pool holds ``--budget`` of the
document pool's KV (default 1/8: the replicas together hold half of the corpus, what
affinity can exploit and a router that scatters documents cannot), plus room for the
running requests' private pages (``--max-ongoing`` per replica).

Metrics: chunk hit rate (chunk tokens served from a replica's cache / chunk tokens asked
for), req/s over the wall time, TTFT p50/p95 measured by the client (first streamed delta,
routing and queueing included), and how the requests spread over the replicas.

The machine's load average is recorded at the start and end of each point: on a shared
CPU, throughput and TTFT move with other jobs, while the chunk hit rate does not.

The document router's own view is traced per measured request (``trace`` in the JSON):
requests that went to a replica other than its first-ranked one (Ray moves on when that
replica's queue is full or its queue-length probe misses ``--queue-len-deadline``), Ray's
unanswered probes, and the chunk tokens the router believed the chosen replica held (Bloom
filter, refreshed every ``--stats-period``, plus what it routed there itself) against what
the replica had cached on arrival.

``--fault``: a replica killed under load. The document router serves a closed loop; after
``--kill-after`` seconds one replica actor is killed with ``ray.kill``, and the load goes on
for ``--after-kill`` seconds more; every request must complete or fail with an error within
``--request-timeout`` (none hangs); Ray Serve's controller starts a replacement, which then
serves requests.

    python benchmarks/ray_router.py                      # 4 replicas, alpha 1.1 and 2.1, 3 routers
    python benchmarks/ray_router.py --fault --replicas 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import sibling  # noqa: E402

rag = sibling("rag_serving")


def make_requests(tok, args, alpha: float, stream: str, n: int) -> list:
    """``rag_serving``'s requests (``--k`` documents drawn independently, Zipf over document
    ranks) or, with ``--topic-size S``, topic-clustered ones: the documents form topics of
    S consecutive ones, a request picks a topic by Zipf(alpha) over topic ranks and ``--k``
    distinct documents of it uniformly, in random order (retrieval returns neighbours).
    Seeded by the seed, alpha and stream only: the same for every router."""
    import random

    if not args.topic_size:
        return rag.make_requests(tok, args, alpha, stream, n)
    rng = random.Random(f"{args.seed}/{alpha}/{stream}/topics{args.topic_size}")
    topics = args.docs // args.topic_size
    weights = [1.0 / (i + 1) ** alpha for i in range(topics)]
    out = []
    for _ in range(n):
        t = rng.choices(range(topics), weights=weights)[0]
        ids = rng.sample(range(t * args.topic_size, (t + 1) * args.topic_size), args.k)
        out.append(rag.Req(rag.make_text(tok, rng.randint(32, 64), rng), ids))
    return out


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


_TRACE: dict = {}  # id(ServeRequest) -> what the document router saw when it ranked the replicas
_PROBES = {"probed": 0, "no_answer": 0}  # Ray's queue-length probes of replicas, and those unanswered


def trace_document_router(handle) -> None:
    """Record, per request, the document router's view when it ranks the replicas: the
    first-ranked replica, the chunk tokens it believes each replica holds (Bloom filter plus
    what it routed there itself) and the queue lengths it has; and count Ray's queue-length
    probes that got no answer within the deadline. Compared with where each request went and
    what that replica actually had cached, this says whether requests left their
    first-ranked replica (Ray moves on when its queue is full or its probe times out) and
    whether the router's picture of the caches was stale. The router runs in this process
    (handle); its instance is wrapped, its behaviour unchanged (best effort: Ray internals)."""
    try:
        router = handle._router._asyncio_router.request_router
    except AttributeError:
        return
    if router is None or getattr(router, "_bench_traced", False) or not hasattr(router, "_holds"):
        return
    choose, probe = router.choose_replicas, router._probe_queue_lens

    async def traced_choose(candidate_replicas, pending_request=None):
        req = router._request_of(pending_request)
        held = None
        if req is not None and req.chunks:
            keyer = router._get_keyer(list(candidate_replicas))
            if keyer is not None:
                chunks = keyer.keys(req.chunks, req.system)
                held = {r.replica_id.unique_id: sum(n for k, n in chunks if router._holds(r)(k))
                        for r in candidate_replicas}
        ranks = await choose(candidate_replicas, pending_request)
        if req is not None and held is not None:
            prev = _TRACE.get(id(req))
            cache = router.replica_queue_len_cache
            _TRACE[id(req)] = dict(top=ranks[0][0].replica_id.unique_id if ranks and ranks[0] else None,
                                   held=held, calls=(prev["calls"] + 1) if prev else 1,
                                   resident=sorted(router._stats(r).get("chunks", -1) for r in candidate_replicas),
                                   queue_lens={r.replica_id.unique_id: cache.get(r.replica_id)
                                               for r in candidate_replicas})
        return ranks

    async def traced_probe(replicas, backoff_index):
        out = await probe(replicas, backoff_index)
        _PROBES["probed"] += len(out)
        _PROBES["no_answer"] += sum(q is None for _, q in out)
        return out

    router.choose_replicas = traced_choose
    router._probe_queue_lens = traced_probe
    router._bench_traced = True


def trace_summary(ok: list) -> dict | None:
    """The document router's traces of the measured requests, summed."""
    xs = [x for x in ok if x.get("trace")]
    if not xs:
        return None
    moved = [x for x in xs if x["trace"]["top"] != x["replica"]]
    pred = [x["trace"]["held"].get(x["replica"], 0) for x in xs]
    act = [x["cached_chunk"] for x in xs]
    return dict(
        traced=len(xs),
        # went to a replica other than the first-ranked one (queue full or probe timeout)
        moved=len(moved),
        moved_held_lost=sum(x["trace"]["held"].get(x["trace"]["top"], 0) - x["trace"]["held"].get(x["replica"], 0)
                            for x in moved),
        retried=sum(x["trace"]["calls"] > 1 for x in xs),
        # a replica believed to hold more of the request's chunk tokens than the first-ranked one
        # was passed over for load (more than load_slack queued above the shortest queue)
        passed_over=sum(x["trace"]["held"].get(x["trace"]["top"], 0) < max(x["trace"]["held"].values())
                        for x in xs),
        passed_over_tokens=sum(max(x["trace"]["held"].values()) - x["trace"]["held"].get(x["trace"]["top"], 0)
                               for x in xs),
        queue_len_unknown=sum(any(q is None for q in x["trace"]["queue_lens"].values()) for x in xs),
        # believed held where it went vs actually cached there on arrival
        believed_tokens=sum(pred), cached_tokens=sum(act),
        over=sum(p > a for p, a in zip(pred, act)), over_tokens=sum(max(p - a, 0) for p, a in zip(pred, act)),
        under=sum(p < a for p, a in zip(pred, act)), under_tokens=sum(max(a - p, 0) for p, a in zip(pred, act)))


def deploy(args, router: str, kv_bytes: int, name: str):
    from ray import serve

    from lazyllm.integrations.ray_serve import build_app

    kw = None
    if router == "documents":  # the others take neither
        kw = dict(load_slack=args.load_slack)
        if args.queue_len_deadline is not None:
            kw["queue_len_deadline_s"] = args.queue_len_deadline
    app = build_app(None, num_replicas=args.replicas, num_cpus=0, router=router, name=name,
                    max_ongoing_requests=args.max_ongoing, stats_period_s=args.stats_period,
                    imbalanced_threshold=args.imbalanced_threshold, torch_threads=1,
                    kv_cache_bytes=kv_bytes, router_kwargs=kw)
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
        if router == "documents":
            trace_document_router(handle)
        sr = ServeRequest(r.question, [docs[i] for i in r.doc_ids],
                          sampling={"max_new_tokens": args.output_tokens})
        out = run_stream(handle, sr, args.request_timeout)
        tr = _TRACE.pop(id(sr), None)
        if tr is not None:
            out["trace"] = tr
        return out

    t = time.perf_counter()
    warm_res, _ = rag.drive(one, warm_reqs, 0.0, args.concurrency, 0)
    warm_s = time.perf_counter() - t
    load0 = os.getloadavg()[0]
    probes0 = dict(_PROBES)
    res, wall = rag.drive(one, reqs, args.rate, args.concurrency, f"{args.seed}/{alpha}")
    load1 = os.getloadavg()[0]
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
               decisions=decisions, load_avg=(load0, load1), trace=trace_summary(ok),
               probes={k: _PROBES[k] - probes0[k] for k in _PROBES} if router == "documents" else None)
    if args.per_request:  # in stream order: replica, chunk tokens asked / cached / believed held there
        # by the document router, client and engine TTFT (s), completion time (s); and where the
        # warm-up requests went
        row["per_request"] = [[x["replica"][-8:], x["chunk"], x["cached_chunk"],
                               x["trace"]["held"].get(x["replica"], 0) if x.get("trace") else None,
                               round(x["ttft"], 4), round(x["engine_ttft"], 4), round(t, 3)]
                              if "error" not in x else None for x, t in res]
        row["warm_replicas"] = [x.get("replica", "")[-8:] for x, _ in warm_res]
        row["resident_chunks"] = [x["trace"]["resident"] for x, _ in res if x.get("trace")]
    if failed:
        row["error"] = failed[0]["error"]
    return row


def _replica_actors(name: str) -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and f"#{name}#" in a["name"]]


def fault(args, docs, reqs, kv_bytes):
    """A replica killed under load: every request completes or fails clearly, none hangs.

    The closed loop runs until at least ``--requests`` requests are done *and*
    ``--after-kill`` seconds have passed since the kill, so the kill always lands while
    requests are in flight. Recovery: the killed replica's actor is gone and the deployment
    has ``--replicas`` RUNNING replicas again, one of them new; then requests over cold
    documents are served (by which replicas, printed)."""
    import itertools

    import ray
    from ray import serve

    from lazyllm.integrations.ray_serve import ServeRequest

    name = "bench-fault"
    handle = deploy(args, "documents", kv_bytes, name)
    time.sleep(2 * args.stats_period)
    before = {a["name"] for a in _replica_actors(name)}
    killed: dict = {}
    lock = threading.Lock()
    counter = itertools.count()
    results: list = []

    def killer():
        time.sleep(args.kill_after)
        victim = sorted(_replica_actors(name), key=lambda a: a["name"])[0]
        with lock:
            killed.update(name=victim["name"], replica=victim["name"].rsplit("#", 1)[-1],
                          at=time.perf_counter() - t0,
                          in_flight=sum(1 for x in inflight.values()))
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)

    inflight: dict = {}

    def worker():
        while True:
            with lock:
                i = next(counter)
                over = "at" in killed and time.perf_counter() - t0 > killed["at"] + args.after_kill
                if i >= args.requests and over:
                    return
                inflight[i] = True
            r = reqs[i % len(reqs)]
            t = time.perf_counter()
            try:
                out = run_stream(handle, ServeRequest(r.question, [docs[j] for j in r.doc_ids],
                                                      sampling={"max_new_tokens": args.output_tokens}),
                                 args.request_timeout)
                x = dict(ok=True, replica=out["replica"])
            except Exception as e:  # the point: what a caller sees
                x = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            x.update(start=t - t0, s=time.perf_counter() - t)
            with lock:
                inflight.pop(i, None)
                results.append(x)

    t0 = time.perf_counter()
    th = threading.Thread(target=killer)
    th.start()
    workers = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    th.join()
    wall = time.perf_counter() - t0
    # recovery: the victim gone, N replicas RUNNING, a new one among them
    deadline = time.perf_counter() + 120
    recovered = None
    while time.perf_counter() < deadline:
        now = {a["name"] for a in _replica_actors(name)}
        st = serve.status().applications[name].deployments[name]
        if (killed["name"] not in now and len(now) >= args.replicas and now - before
                and st.replica_states.get("RUNNING", 0) >= args.replicas):
            recovered = time.perf_counter() - t0
            break
        time.sleep(0.5)
    new = sorted(a.rsplit("#", 1)[-1] for a in {a["name"] for a in _replica_actors(name)} - before)
    time.sleep(2 * args.stats_period)
    after = [handle.generate.remote(ServeRequest(f"Still there {i}?", [f"A new document {i}: " + "word " * 40],
                                                 sampling={"max_new_tokens": 2})) for i in range(4 * args.replicas)]
    served_after: dict = {}
    for a in after:
        rep = a.result(timeout_s=args.request_timeout)["replica"]
        served_after[rep] = served_after.get(rep, 0) + 1
    serve.delete(name)
    xs = results
    errors: dict = {}
    for x in xs:
        if not x["ok"]:
            key = x["error"].split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    hung = sum(x["s"] >= args.request_timeout for x in xs)
    spanning = sum(x["start"] <= killed["at"] <= x["start"] + x["s"] for x in xs)
    on_victim = sum(x.get("replica") == killed["replica"] for x in xs)
    print(f"\nFault test: {len(xs)} requests, {args.replicas} replicas, closed loop of {args.concurrency}; "
          f"killed {killed['name']} at {killed['at']:.1f} s with {killed['in_flight']} requests in flight "
          f"({spanning} requests spanned the kill); load ran {wall:.1f} s")
    print(f"- completed: {sum(x['ok'] for x in xs)} ({on_victim} of them on the killed replica, before the kill), "
          f"failed with an error: {sum(not x['ok'] for x in xs)} {errors}, "
          f"hung (over {args.request_timeout:g} s): {hung}")
    print(f"- slowest request {max(x['s'] for x in xs):.1f} s; "
          + (f"replaced: {args.replicas} RUNNING with new replica {new} at {recovered:.1f} s"
             if recovered is not None else "NOT replaced within 120 s")
          + f"; {len(after)} requests after recovery served by {served_after}")
    for x in xs:
        if not x["ok"]:
            print(f"  error after {x['s']:.1f} s: {x['error']}")
            break
    return dict(requests=len(xs), completed=sum(x["ok"] for x in xs), failed=errors, hung=hung, killed=killed,
                spanning_kill=spanning, recovered_s=recovered, new_replicas=new, served_after=served_after,
                wall_s=wall)


def plot(rows, out_dir, title, name="router_comparison.png"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    routers = list(dict.fromkeys(r["router"] for r in rows))
    alphas = sorted({r["alpha"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, label) in zip(axes, [("hit_rate", "chunk hit rate"), ("req_per_s", "req/s"),
                                       ("ttft_p50_ms", "TTFT p50 (ms, client)")]):
        w = 0.8 / len(routers)
        for i, router in enumerate(routers):
            ys = [next((r[key] for r in rows if r["router"] == router and r["alpha"] == a), float("nan"))
                  for a in alphas]
            xs = [j + i * w for j in range(len(alphas))]
            ax.bar(xs, ys, w, label=router, color=f"C{i}")
            for x, y in zip(xs, ys):
                if y == y:  # not nan
                    ax.text(x, y, f"{y:.2f}" if key != "ttft_p50_ms" else f"{y:.0f}", ha="center",
                            va="bottom", fontsize=7)
        ax.set_xticks([j + w * (len(routers) - 1) / 2 for j in range(len(alphas))])
        ax.set_xticklabels([f"alpha {a:g}" for a in alphas])
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--routers", default="documents,default,prefix")
    ap.add_argument("--alphas", default="1.1,2.1")
    ap.add_argument("--docs", type=int, default=256)
    ap.add_argument("--doc-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--topic-size", type=int, default=0,
                    help="topic-clustered requests: k documents of one Zipf-chosen topic of this many (0: independent)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--warm-requests", type=int, default=48)
    ap.add_argument("--output-tokens", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=None, help="closed-loop clients (default: --replicas)")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: closed loop)")
    ap.add_argument("--max-ongoing", type=int, default=4, help="max_ongoing_requests per replica")
    ap.add_argument("--budget", type=float, default=0.125,
                    help="KV pool per replica as a fraction of the document pool")
    ap.add_argument("--stats-period", type=float, default=1.0, help="request_routing_stats_period_s")
    ap.add_argument("--imbalanced-threshold", type=float, default=4)
    ap.add_argument("--load-slack", type=float, default=1, help="document router's load_slack")
    ap.add_argument("--queue-len-deadline", type=float, default=None,
                    help="document router's queue_len_deadline_s: how long Ray's queue-length probe of "
                         "the first-ranked replica may take before the request moves on (default: Ray's, 0.1 s)")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--fault", action="store_true", help="kill a replica under load instead")
    ap.add_argument("--kill-after", type=float, default=15)
    ap.add_argument("--after-kill", type=float, default=15,
                    help="--fault: keep the load on this many seconds after the kill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--per-request", action="store_true", help="--json: also each measured request's figures")
    ap.add_argument("--plots", default=None, help="folder for the plot")
    ap.add_argument("--plot-name", default="router_comparison.png")
    args = ap.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = args.replicas
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
    budget = args.budget
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
            reqs = make_requests(tok, args, alphas[0], "fault", args.requests)
            out = fault(args, docs, reqs, kv_bytes)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "fault": out}, f, indent=2)
            return out
        for a in alphas:
            warm_reqs = make_requests(tok, args, a, "warm", args.warm_requests)
            reqs = make_requests(tok, args, a, "rate0", args.requests)
            for router in args.routers.split(","):
                row = point(args, router, a, docs, warm_reqs, reqs, kv_bytes)
                rows.append(row)
                if args.json:  # after every point: a run cut short keeps its figures
                    with open(args.json, "w") as f:
                        json.dump({"args": vars(args), "rows": rows}, f, indent=2)
                print(f"  {router:9s} alpha={a:g}: hit rate {row['hit_rate']:.2f}, {row['req_per_s']:.2f} req/s, "
                      f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, spread {row['spread']}, failed {row['failed']}, "
                      f"load avg {row['load_avg'][0]:.1f}-{row['load_avg'][1]:.1f}, "
                      f"decisions {row['decisions']} trace {row['trace']} probes {row['probes']} "
                      f"(start {row['startup_s']:.0f} s, warm-up {row['warm_s']:.0f} s, "
                      f"measured {row['wall_s']:.0f} s)",
                      flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    topics = f" in topics of {args.topic_size}" if args.topic_size else ""
    title = (f"{args.replicas} replicas of SmolLM2-135M on a {os.cpu_count()}-core CPU, {args.docs} docs x "
             f"{args.doc_tokens} tokens, k={args.k}{topics}, KV per replica {budget:.2f} of the documents, "
             f"{time.strftime('%Y-%m-%d')}")
    loop = f"Poisson at {args.rate:g}/s" if args.rate > 0 else f"closed loop of {args.concurrency}"
    print(f"\nRouters, {title}; {args.requests} requests per point after {args.warm_requests} warm-up, {loop}, "
          f"{args.output_tokens} output tokens, {time.perf_counter() - t_start:.0f} s in all")
    print("| router | alpha | done/failed | chunk hit rate | req/s | TTFT p50 ms | TTFT p95 ms | engine TTFT p50 ms "
          "| requests per replica | load avg | decisions |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |")
    for r in rows:
        print(f"| {r['router']} | {r['alpha']:g} | {r['requests']}/{r['failed']} | {r['hit_rate']:.2f} | "
              f"{r['req_per_s']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | "
              f"{r['engine_ttft_p50_ms']:.0f} | {r['spread']} | {r['load_avg'][0]:.1f}-{r['load_avg'][1]:.1f} | "
              f"{r['decisions'] or ''} |")
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
        print("plot:", plot(rows, args.plots, title, args.plot_name))
    return rows


if __name__ == "__main__":
    main()
