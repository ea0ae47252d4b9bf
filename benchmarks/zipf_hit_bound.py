"""Upper bounds on the chunk hit rate of the serving workload (``rag_serving.py``), from the
workload alone: with ``C`` documents' KV resident, no cache policy hits more often than one
that holds the ``C`` most popular documents. Prints, per budget, that bound for ``lazy``
(the budget holds about ``budget * docs`` documents) and for ``block`` running one request at
a time (its re-rotated copies of the request's ``k`` documents take ``k`` documents' worth of
the same pool), and the ratio of the two bounds.

    python benchmarks/zipf_hit_bound.py [--alpha 2.1] [--docs 100] [--k 5]
"""
from __future__ import annotations

import argparse

import numpy as np


def top_c_share(alpha: float, docs: int, k: int, samples: int = 200_000, seed: int = 0) -> np.ndarray:
    """``share[c]``: the fraction of retrievals that fall on the ``c`` most popular documents,
    each request drawing ``k`` distinct documents with Zipf(alpha) weights (as the benchmark)."""
    rng = np.random.default_rng(seed)
    p = np.arange(1, docs + 1, dtype=np.float64) ** -alpha
    p /= p.sum()
    # k distinct draws: Gumbel top-k is sampling without replacement with weights p
    g = np.log(p)[None, :] + rng.gumbel(size=(samples, docs))
    picks = np.argpartition(-g, k, axis=1)[:, :k]
    counts = np.bincount(picks.ravel(), minlength=docs)
    return np.concatenate([[0.0], np.cumsum(counts) / counts.sum()])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--alpha", type=float, default=2.1)
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--budgets", default="0.12,0.2,0.33,0.5")
    args = ap.parse_args()
    share = top_c_share(args.alpha, args.docs, args.k)
    print(f"alpha {args.alpha}, {args.docs} documents, {args.k} per request")
    print("| KV budget | documents held | lazy bound | block bound (one request in flight) | ratio of bounds |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for b in (float(x) for x in args.budgets.split(",")):
        c = int(round(b * args.docs))
        lazy = share[min(c, args.docs)]
        cb = c - args.k
        block = share[cb] if cb > 0 else float("nan")
        print(f"| {b:g} | {c} | {lazy:.3f} | {block:.3f} | {lazy / block:.2f} |")


if __name__ == "__main__":
    main()
