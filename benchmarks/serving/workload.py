"""``rag_serving.py``'s workload: seeded documents of a token count, requests over them by
Zipf popularity, Poisson or closed-loop arrivals (``drive``), and the chunk tokens of a
prompt."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "lambda", "zeta"]


@dataclass
class Req:
    question: str
    doc_ids: list[int]


def make_text(tok, n_tokens: int, rng: random.Random) -> str:
    """Text of at most (about) ``n_tokens`` tokens of random words (deterministic given
    ``rng``): the longest prefix of the drawn words that fits, found by bisection."""
    def count(ws):
        return len(tok(" ".join(ws), add_special_tokens=False)["input_ids"])

    words: list[str] = []
    while count(words) < n_tokens:
        words.extend(f"{rng.choice(WORDS)}{rng.randint(0, 9999)}" for _ in range(max(4, n_tokens // 8)))
    lo, hi = 1, len(words)  # the longest prefix with count <= n_tokens (at least one word)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(words[:mid]) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def zipf_sample(rng: random.Random, n_docs: int, k: int, alpha: float) -> list[int]:
    weights = [1.0 / (i + 1) ** alpha for i in range(n_docs)]
    chosen: list[int] = []
    while len(chosen) < k:
        i = rng.choices(range(n_docs), weights=weights)[0]
        if i not in chosen:
            chosen.append(i)
    rng.shuffle(chosen)
    return chosen


def make_docs(tok, args) -> list[str]:
    rng = random.Random(args.seed)
    return [make_text(tok, args.doc_tokens, rng) for _ in range(args.docs)]


def make_requests(tok, args, alpha: float, stream: str, n: int) -> list[Req]:
    """``n`` requests of one stream (a measured point or the warm-up), seeded by the seed,
    alpha and stream name only: the same for every system."""
    rng = random.Random(f"{args.seed}/{alpha}/{stream}")
    return [Req(make_text(tok, rng.randint(32, 64), rng), zipf_sample(rng, args.docs, args.k, alpha))
            for _ in range(n)]


def arrivals(n: int, rate: float, seed) -> list[float]:
    """Poisson arrival times, rescaled so the n-th is at exactly ``n / rate``."""
    rng = random.Random(f"{seed}/arrivals")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    scale = (n / rate) / out[-1] if out else 1.0
    return [x * scale for x in out]


def drive(run_one, reqs, rate: float, concurrency: int, seed):
    """Submit requests (Poisson at ``rate`` or closed loop) and collect each ``run_one``
    result with its completion time (seconds from the start) as ``(result, done_at)``."""
    results: list = [None] * len(reqs)
    t0 = time.perf_counter()

    def call(i):
        try:
            res = run_one(reqs[i])
        except Exception as e:  # e.g. out of memory in transformers: reported as a failed request
            res = dict(error=repr(e))
        results[i] = (res, time.perf_counter() - t0)

    if rate > 0:
        threads = []
        for i, at in enumerate(arrivals(len(reqs), rate, seed)):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=call, args=(i,))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
    else:
        nxt = iter(range(len(reqs)))
        lock = threading.Lock()

        def worker():
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                call(i)

        ws = [threading.Thread(target=worker) for _ in range(max(1, concurrency))]
        for w in ws:
            w.start()
        for w in ws:
            w.join()
    return results, time.perf_counter() - t0


def chunk_tokens_of(segments) -> int:
    return sum(len(ids) for kind, ids in segments if kind == "chunk")


def cached_chunk_tokens_of_prefix(segments, cached: int) -> int:
    """Chunk tokens inside the first ``cached`` prompt tokens (identical-prefix reuse)."""
    pos, out = 0, 0
    for kind, ids in segments:
        if kind == "chunk":
            out += max(0, min(cached, pos + len(ids)) - pos)
        pos += len(ids)
    return out
