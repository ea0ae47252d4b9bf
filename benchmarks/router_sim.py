"""Routing simulation: the workload of ``ray_router.py`` (same request generators) routed
over replicas whose caches are LRUs of documents, without a model, so that tens of
thousands of requests per point take seconds instead of hours.

What is simulated. ``--replicas`` replicas, each caching at most ``--capacity`` documents
(default ``--docs`` / 8, the benchmark's KV budget of 1/8 of the document pool), least
recently used evicted first; a request's documents are looked up on the replica it is
routed to, the missing ones computed and inserted (a hit or a miss per document: every
document has the same number of tokens, so this is the chunk hit rate). Requests come
from a closed loop of ``--concurrency`` clients (default one per replica, as in the
benchmark); a replica serves its requests one at a time in arrival order, each taking
``1 + --miss-cost x (documents missed)`` time units (a miss is a prefill of the document).
The router sees exact queue lengths (requests routed to a replica and not finished) and,
for the document routers, exactly which documents each replica holds (the real router
sees a Bloom filter refreshed every second plus what it routed there itself).

Workloads: ``ray_router.make_requests`` (documents drawn independently, Zipf over
document ranks, ``rag_serving``'s generator; or ``--topic-size 8``: a Zipf-chosen topic, 3 of
its 8 documents), loaded from its file. Their question texts are built with a
whitespace tokenizer instead of the model's (the documents drawn are what matters), so
the draws have the benchmark's distribution, not its exact sequence; ``--replay`` also
runs the benchmark's exact request streams (48 warm-up + 96 measured, built with the
model's tokenizer), over ``--replay-seeds`` router seeds.

Routers:

* ``random``: uniform.
* ``default``: Ray's default, power of two choices on queue length.
* ``documents``: ``DocumentAffinityRouter``'s policy, ``rank_replicas`` itself (held
  tokens, rendezvous owner of cold chunks, load slack 1, imbalance threshold 4).
* ``documents-slack2``: the same with ``load_slack`` 2.
* ``minhash``: as ``documents``, but ties on held documents (a request no cache helps,
  among others) go to the rendezvous owner of the request's MinHash document (its
  document whose key hashes lowest), so two requests land together with probability their
  Jaccard similarity; ``minhash-cold``: the MinHash of the documents no replica holds.
* ``minhash-first``: consistent hashing only: the MinHash document's owner first (load
  slack kept), held documents ignored.
* ``hot-warm``: replicate hot, partition warm: documents in at least ``--hot-share`` of
  the last ``--hot-window`` requests count as everywhere and are left out of the scores;
  the rest are routed by held documents, then to the owner of the request's most requested
  non-hot document.
* ``fill-first``: as ``documents``, but ties on held documents go first to the replica
  caching the fewest documents (an empty cache takes new documents), then to the owners of
  the cold documents.
* ``static-h``, an oracle (not a router): every replica holds the ``h`` most popular
  documents, the next ``R x (C - h)`` are partitioned in contiguous blocks (a topic stays
  together), nothing else is cached, each request goes to the replica holding most of its
  documents among those at most 1.25x the mean load; the best ``h`` is reported.
* ``ceiling``: the fraction of the measured documents that are among the ``R x C`` most
  requested: what the caches could hit if they held disjoint sets of the most popular
  documents and every request found all of its documents on the replica it went to.
  On the benchmark's short streams, ``seen-before`` instead: the fraction of the measured
  documents used earlier in the stream (a first use is a miss whatever the router).

Every router but ``random`` and ``default`` keeps the policy's guarantees: power of two
choices when queues differ by more than ``--imbalanced-threshold``, and replicas more than
``--load-slack`` queued requests above the shortest passed over.

    python benchmarks/router_sim.py                        # 20,000 measured requests per point
    python benchmarks/router_sim.py --replay               # plus the benchmark's own 144-request streams
"""
from __future__ import annotations

import argparse
import hashlib
import heapq
import os
import random
import statistics
import sys
import time
from collections import Counter, OrderedDict, deque

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import sibling  # noqa: E402


class WordTokenizer:
    """A stand-in for the model's tokenizer in ``rag_serving.make_text``: one token per word."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def workload(args, alpha: float, stream: str, n: int, tok=None) -> list[list[int]]:
    """Document ids of ``n`` requests of ``ray_router.make_requests`` (``args.topic_size``
    selects the topic-clustered generator)."""
    rr = sibling("ray_router")
    return [r.doc_ids for r in rr.make_requests(tok or WordTokenizer(), args, alpha, stream, n)]


# -- routers ----------------------------------------------------------------------------

def _key(doc: int) -> bytes:
    return hashlib.blake2b(f"doc-{doc}".encode(), digest_size=20).digest()


class Router:
    name = "?"

    def __init__(self, n_replicas: int, rng: random.Random, args):
        self.n, self.rng, self.args = n_replicas, rng, args
        self.ids = [f"replica-{i}" for i in range(n_replicas)]

    def route(self, docs: list[int], queues: list[int], caches: list[OrderedDict]) -> int:
        raise NotImplementedError


class RandomRouter(Router):
    name = "random"

    def route(self, docs, queues, caches):
        return self.rng.randrange(self.n)


class PowerOfTwo(Router):
    name = "default"

    def route(self, docs, queues, caches):
        a, b = self.rng.sample(range(self.n), 2)
        if queues[a] == queues[b]:
            return a
        return a if queues[a] < queues[b] else b


class RankRouter(Router):
    """``rank_replicas`` (the real policy) over the simulated caches."""

    name = "documents"
    load_slack = None  # None: --load-slack

    def __init__(self, n_replicas, rng, args):
        super().__init__(n_replicas, rng, args)
        from lazyllm.integrations.ray_serve import rank_replicas

        self.rank = rank_replicas
        self.keys = {}
        self.doc_of = {}

    def key(self, d):
        k = self.keys.get(d)
        if k is None:
            k = self.keys[d] = _key(d)
            self.doc_of[k] = d
        return k

    def route(self, docs, queues, caches):
        chunks = [(self.key(d), 96) for d in docs]
        holds = {rid: (lambda k, c=caches[i]: self.doc_of[k] in c) for i, rid in enumerate(self.ids)}
        q = dict(zip(self.ids, queues))
        d = self.rank(chunks, holds, q, imbalanced_threshold=self.args.imbalanced_threshold, rng=self.rng,
                      load_slack=self.load_slack if self.load_slack is not None else self.args.load_slack)
        first = d.ranks[0]
        rid = first[0] if len(first) == 1 else min(first, key=lambda r: q[r])
        return self.ids.index(rid)


def _owner(key: bytes, ids) -> int:
    """The index in ``ids`` of ``key``'s rendezvous owner (the router's own rule)."""
    from lazyllm.integrations.ray_serve import rendezvous_owner

    return ids.index(rendezvous_owner(key, ids))


class _Owned(Router):
    """Shared pieces: the load slack filter and per-document rendezvous owners."""

    def __init__(self, n_replicas, rng, args):
        super().__init__(n_replicas, rng, args)
        self._own: dict[int, int] = {}
        self._hash: dict[int, bytes] = {}

    def owner(self, d):
        o = self._own.get(d)
        if o is None:
            o = self._own[d] = _owner(_key(d), self.ids)
        return o

    def minhash_doc(self, docs):
        return min(docs, key=lambda d: self._hash.setdefault(d, _key(d)))

    def free(self, queues):
        if max(queues) - min(queues) > self.args.imbalanced_threshold:
            return None
        s = min(queues)
        return [i for i in range(self.n) if queues[i] <= s + self.args.load_slack]

    def p2c(self, queues):
        a, b = self.rng.sample(range(self.n), 2)
        return a if queues[a] <= queues[b] else b


class MinHash(_Owned):
    """``rank_replicas`` with another placement: ties on held documents go to the rendezvous
    owner of the request's MinHash document (all of its documents, or ``cold``: those no
    replica holds, when there are any)."""

    name = "minhash"
    cold = False

    def route(self, docs, queues, caches):
        ok = self.free(queues)
        if ok is None:
            return self.p2c(queues)
        held = [sum(d in caches[i] for d in docs) for i in range(self.n)]
        pool = [d for d in docs if not any(d in c for c in caches)] if self.cold else []
        o = self.owner(self.minhash_doc(pool or docs))
        return min(range(self.n), key=lambda i: (i not in ok, -held[i], i != o, queues[i], self.rng.random()))


class MinHashCold(MinHash):
    name = "minhash-cold"
    cold = True


class MinHashFirst(_Owned):
    name = "minhash-first"

    def route(self, docs, queues, caches):
        ok = self.free(queues)
        if ok is None:
            return self.p2c(queues)
        o = self.owner(self.minhash_doc(docs))
        if o in ok:
            return o
        return min(ok, key=lambda i: (queues[i], self.rng.random()))


class HotWarm(_Owned):
    name = "hot-warm"

    def __init__(self, n_replicas, rng, args):
        super().__init__(n_replicas, rng, args)
        self.window: deque = deque()
        self.seen: Counter = Counter()

    def route(self, docs, queues, caches):
        w = self.args.hot_window
        hot = {d for d in docs if self.seen[d] >= self.args.hot_share * max(1, len(self.window))}
        self.window.append(docs)
        self.seen.update(docs)
        if len(self.window) > w:
            self.seen.subtract(self.window.popleft())
        ok = self.free(queues)
        if ok is None:
            return self.p2c(queues)
        warm = [d for d in docs if d not in hot] or list(docs)
        anchor = max(warm, key=lambda d: (self.seen[d], -d))
        o = self.owner(anchor)
        held = [sum(d in caches[i] for d in warm) for i in range(self.n)]
        return min(ok, key=lambda i: (-held[i], i != o, queues[i], self.rng.random()))


class FillFirst(_Owned):
    """Prototype: held tokens first; ties to the replica holding fewest documents (an empty
    cache takes new documents first), then the MinHash document's owner."""

    name = "fill-first"

    def route(self, docs, queues, caches):
        ok = self.free(queues)
        if ok is None:
            return self.p2c(queues)
        busy = [i not in ok for i in range(self.n)]
        held = [sum(d in caches[i] for d in docs) for i in range(self.n)]
        owned = [0] * self.n
        for d in docs:
            if not any(d in c for c in caches):
                owned[self.owner(d)] += 1
        return min(range(self.n), key=lambda i: (busy[i], -held[i], len(caches[i]), -owned[i], queues[i],
                                                 self.rng.random()))


class RankSlack2(RankRouter):
    """``rank_replicas`` with ``load_slack`` 2 (the benchmark's router has 1)."""

    name = "documents-slack2"
    load_slack = 2


ROUTERS = {c.name: c for c in (RandomRouter, PowerOfTwo, RankRouter, RankSlack2, MinHash, MinHashCold, MinHashFirst,
                                HotWarm, FillFirst)}


# -- the simulation ----------------------------------------------------------------------

def simulate(router: Router, warm: list[list[int]], reqs: list[list[int]], args) -> dict:
    """Closed loop of ``args.concurrency`` clients over the warm-up then the measured requests."""
    n = router.n
    caches = [OrderedDict() for _ in range(n)]
    queues = [0] * n
    free_at = [0.0] * n
    per_replica = [0] * n
    hits = looked = 0
    stream = warm + reqs
    events: list = []  # (done_at, seq, replica)
    nxt = 0
    now = 0.0
    seq = 0

    def submit(t):
        nonlocal nxt, hits, looked, seq
        i = nxt
        nxt += 1
        docs = stream[i]
        r = router.route(docs, queues, caches)
        c = caches[r]
        miss = 0
        for d in docs:
            if d in c:
                c.move_to_end(d)
                if i >= len(warm):
                    hits += 1
            else:
                miss += 1
                c[d] = None
                if len(c) > args.capacity:
                    c.popitem(last=False)
        if i >= len(warm):
            looked += len(docs)
            per_replica[r] += 1
        queues[r] += 1
        start = max(t, free_at[r])
        free_at[r] = start + 1.0 + args.miss_cost * miss
        seq += 1
        heapq.heappush(events, (free_at[r], seq, r))

    for _ in range(min(args.concurrency, len(stream))):
        submit(0.0)
    while events:
        now, _, r = heapq.heappop(events)
        queues[r] -= 1
        if nxt < len(stream):
            submit(now)
    mean = len(reqs) / n
    return dict(hit_rate=hits / max(looked, 1), spread=sorted(per_replica, reverse=True),
                max_over_mean=max(per_replica) / mean, max_over_min=max(per_replica) / max(min(per_replica), 1),
                throughput=(len(warm) + len(reqs)) / now if now else float("nan"))


def ceiling(reqs: list[list[int]], slots: int) -> float:
    c = Counter(d for r in reqs for d in r)
    return sum(v for _, v in c.most_common(slots)) / sum(c.values())


def static_oracle(reqs, n_replicas: int, capacity: int, docs_by_rank: list[int], cap_factor: float = 1.25):
    """Best over h of: top h documents everywhere, the next n x (capacity - h) partitioned in
    contiguous blocks, ideal routing under a load cap (see the module doc). (hit rate, h, spread)."""
    best = None
    for h in range(0, capacity + 1):
        where: dict[int, set] = {}
        for d in docs_by_rank[:h]:
            where[d] = set(range(n_replicas))
        rest = docs_by_rank[h:h + n_replicas * (capacity - h)]
        block = capacity - h
        for j, d in enumerate(rest):
            where[d] = {j // block} if block else set()
        load = [0] * n_replicas
        cap = cap_factor * len(reqs) / n_replicas
        hits = looked = 0
        for docs in reqs:
            score = [0] * n_replicas
            for d in docs:
                for r in where.get(d, ()):
                    score[r] += 1
            ok = [r for r in range(n_replicas) if load[r] + 1 <= cap] or list(range(n_replicas))
            r = max(ok, key=lambda r: (score[r], -load[r]))
            load[r] += 1
            hits += score[r]
            looked += len(docs)
        hr = hits / looked
        if best is None or hr > best[0]:
            best = (hr, h, sorted(load, reverse=True))
    return best


def docs_by_popularity(args) -> list[int]:
    """Document ids, most popular first (the generators' ranks: ids in order)."""
    return list(range(args.docs))


def seen_before(warm, reqs) -> float:
    """The share of the measured documents used earlier in the stream (warm-up included):
    a bound on any router's hit rate from empty caches (a first use is a miss)."""
    seen = {d for r in warm for d in r}
    ok = n = 0
    for r in reqs:
        for d in r:
            ok += d in seen
            n += 1
        seen.update(r)
    return ok / n


def run_point(args, workload_name: str, alpha: float, routers, warm, reqs, seeds=(0,)) -> list[dict]:
    res = {}
    for name in routers:
        res[name] = [simulate(ROUTERS[name](args.replicas, random.Random(f"{args.seed}/{name}/{s}"), args),
                              warm, reqs, args) for s in seeds]
    rows = []
    for name, xs in res.items():
        ratios = [x["hit_rate"] / b["hit_rate"] for x, b in zip(xs, res["default"])]
        rows.append(dict(router=name, workload=workload_name, alpha=alpha,
                         hit_rate=statistics.mean(x["hit_rate"] for x in xs),
                         ratio_range=(min(ratios), max(ratios)),
                         max_over_mean=statistics.mean(x["max_over_mean"] for x in xs),
                         max_over_min=statistics.mean(x["max_over_min"] for x in xs),
                         throughput=statistics.mean(x["throughput"] for x in xs),
                         spread=[round(statistics.mean(x["spread"][i] for x in xs)) for i in range(args.replicas)]))
    nan = float("nan")
    if len(reqs) > 2 * args.replicas * args.capacity:
        bound = dict(router="ceiling", hit_rate=ceiling(reqs, args.replicas * args.capacity))
    else:
        bound = dict(router="seen-before", hit_rate=seen_before(warm, reqs))
    rows.append(dict(bound, workload=workload_name, alpha=alpha, max_over_mean=nan, max_over_min=nan,
                     throughput=nan, spread=[]))
    if args.oracle:
        hr, h, load = static_oracle(reqs, args.replicas, args.capacity, docs_by_popularity(args))
        mean = len(reqs) / args.replicas
        rows.append(dict(router=f"static-{h}", workload=workload_name, alpha=alpha, hit_rate=hr,
                         max_over_mean=max(load) / mean, max_over_min=max(load) / max(min(load), 1),
                         throughput=nan, spread=load))
    base = next(r["hit_rate"] for r in rows if r["router"] == "default")
    for r in rows:
        r["ratio"] = r["hit_rate"] / base
    return rows


def _f(x, p=2) -> str:
    return "" if x != x else f"{x:.{p}f}"


def table(rows, title, ranges=False):
    print(f"\n{title}")
    print("| router | workload | alpha | chunk hit rate | vs default | " + ("per-seed range | " if ranges else "")
          + "max/mean requests | max/min requests | throughput (req/unit) |")
    print("| --- | --- | ---: | ---: | ---: | " + ("---: | " if ranges else "") + "---: | ---: | ---: |")
    for r in rows:
        rng = ""
        if ranges:
            lo, hi = r.get("ratio_range", (float("nan"),) * 2)
            rng = f"{lo:.2f}-{hi:.2f} | " if lo == lo else " | "
        print(f"| {r['router']} | {r['workload']} | {r['alpha']:g} | {r['hit_rate']:.3f} | {r['ratio']:.2f}x | {rng}"
              f"{_f(r['max_over_mean'])} | {_f(r['max_over_min'])} | {_f(r['throughput'], 3)} |")


def pivot(rows, title):
    """One row per router, one column per (workload, alpha): hit rate, ratio to the default
    router, busiest replica's requests over the mean."""
    cols = list(dict.fromkeys((r["workload"], r["alpha"]) for r in rows))
    names = list(dict.fromkeys(r["router"] if not r["router"].startswith("static-") else "static" for r in rows))
    print(f"\n{title}")
    print("| router | " + " | ".join(f"{w} {a:g}" for w, a in cols) + " |")
    print("| --- | " + " | ".join("---:" for _ in cols) + " |")
    for name in names:
        cells = []
        for w, a in cols:
            r = next((r for r in rows if r["workload"] == w and r["alpha"] == a
                      and (r["router"] == name or (name == "static" and r["router"].startswith("static-")))), None)
            if r is None:
                cells.append("")
                continue
            extra = f", h={r['router'][7:]}" if name == "static" else ""
            bal = f", {r['max_over_mean']:.2f}" if r["max_over_mean"] == r["max_over_mean"] else ""
            cells.append(f"{r['hit_rate']:.2f} ({r['ratio']:.2f}x{bal}{extra})")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--docs", type=int, default=256)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--capacity", type=int, default=None, help="documents per replica cache (default docs / 8)")
    ap.add_argument("--alphas", default="1.1,2.1")
    ap.add_argument("--workloads", default="independent,topics")
    ap.add_argument("--topic-size", type=int, default=8, help="topic size of the topics workload")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--warm-requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--miss-cost", type=float, default=1.0, help="service time of a missed document (units)")
    ap.add_argument("--imbalanced-threshold", type=float, default=4)
    ap.add_argument("--load-slack", type=float, default=1)
    ap.add_argument("--hot-share", type=float, default=0.05,
                    help="hot-warm: a document in at least this share of recent requests is hot")
    ap.add_argument("--hot-window", type=int, default=512)
    ap.add_argument("--no-oracle", dest="oracle", action="store_false")
    ap.add_argument("--replay", action="store_true",
                    help="also the benchmark's exact streams (model tokenizer), 48 warm-up + 96 measured")
    ap.add_argument("--replay-seeds", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.capacity = args.capacity or args.docs // 8
    args.concurrency = args.concurrency or args.replicas
    t0 = time.perf_counter()
    routers = args.routers.split(",")
    rows = []
    for wl in args.workloads.split(","):
        for a in (float(x) for x in args.alphas.split(",")):
            ns = argparse.Namespace(**{**vars(args), "topic_size": args.topic_size if wl == "topics" else 0})
            warm = workload(ns, a, "sim-warm", args.warm_requests)
            reqs = workload(ns, a, "sim", args.requests)
            rows += run_point(ns, wl, a, routers, warm, reqs)
            print(f"  {wl} alpha {a:g} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    title = (f"Steady state: {args.replicas} replicas, {args.docs} documents, {args.k} per request, "
                f"LRU of {args.capacity} documents per replica, closed loop of {args.concurrency}, "
                f"{args.requests} requests after {args.warm_requests} warm-up")
    table(rows, title)
    pivot(rows, title + ": hit rate (ratio to default, busiest replica's requests / mean)")
    if args.replay:
        from transformers import AutoTokenizer

        from lazyllm.model.loader import default_model_dir

        tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
        rrows = []
        for wl in args.workloads.split(","):
            for a in (float(x) for x in args.alphas.split(",")):
                ns = argparse.Namespace(**{**vars(args), "topic_size": args.topic_size if wl == "topics" else 0,
                                           "oracle": False})
                warm = workload(ns, a, "warm", 48, tok)
                reqs = workload(ns, a, "rate0", 96, tok)
                rrows += run_point(ns, wl, a, routers, warm, reqs, seeds=range(args.replay_seeds))
        title = (f"The benchmark's own streams (48 warm-up + 96 measured requests), LRU of {args.capacity} "
                 f"documents per replica, mean over {args.replay_seeds} router seeds")
        table(rrows, title, ranges=True)
        pivot(rrows, title + ": hit rate (ratio to default, busiest replica's requests / mean)")
        rows += rrows
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return rows


if __name__ == "__main__":
    main()
