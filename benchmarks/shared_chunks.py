"""Shared-chunk attention against the per-request decode kernel, one layer (GPU).

Llama-3.1-8B heads (32 query / 8 KV heads, d=128), bf16, pages of 64 tokens. A decode step
of ``B`` requests, each with 8 chunks of 512 tokens (in its own order, at its own offsets)
plus a 64-token question page and a partly filled page of generated tokens:

* ``shared``: every request holds the same 8 chunks;
* ``own``: every request holds 8 chunks of its own (nothing to share: the engine keeps the
  per-request kernel there, shown for the planner's cost and as a check);
* ``zipf``: 5 of 100 documents per request, drawn by Zipf (alpha 1.1).

For each: the per-request decode kernel (``paged_attention_triton``, what the engine runs
without sharing), the grouped kernel (``grouped_attention_triton``) for several work-item
shapes, both from CUDA graphs (``do_bench_cudagraph`` medians), the largest difference
between them, and the floor: the distinct KV bytes of the step at the measured copy
bandwidth. ``--json`` writes the rows.

    python benchmarks/shared_chunks.py [--batch 16 64 128] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

HQ, HKV, D, PS = 32, 8, 128, 64
CHUNK_PAGES = 8


def llama3_inv_freq(dim=128, theta=500000.0, factor=8.0, low=1.0, high=4.0, orig=8192):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    wavelen = 2 * torch.pi / inv
    lo_wl, hi_wl = orig / low, orig / high
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
    mid = (wavelen <= lo_wl) & (wavelen >= hi_wl)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def build_step(kind: str, batch: int, seed: int = 0, n_docs: int = 100, per_req: int = 5, alpha: float = 1.1):
    """Host tables of one decode step: rows of (page, pos, delta, len) entries and the
    number of pages in the pool."""
    rng = random.Random(seed)
    n_pages = 0
    docs = []
    n_doc = 8 if kind == "shared" else (batch * 8 if kind == "own" else n_docs)
    for _ in range(n_doc):
        docs.append((list(range(n_pages, n_pages + CHUNK_PAGES)), rng.randrange(0, 4096)))
        n_pages += CHUNK_PAGES
    weights = [1.0 / (i + 1) ** alpha for i in range(n_docs)]
    rows = []
    for b in range(batch):
        if kind == "shared":
            picks = rng.sample(range(8), 8)
        elif kind == "own":
            picks = list(range(8 * b, 8 * b + 8))
        else:
            picks = []
            while len(picks) < per_req:
                d = rng.choices(range(n_docs), weights)[0]
                if d not in picks:
                    picks.append(d)
        entries, pos = [], 16
        for d in picks:
            pages, c0 = docs[d]
            for i, p in enumerate(pages):
                entries.append((p, pos + i * PS, pos - c0, PS))
            pos += CHUNK_PAGES * PS
        entries.append((n_pages, pos, 0, PS))  # the question
        n_pages += 1
        pos += PS
        gen = rng.randint(1, PS)
        entries.append((n_pages, pos, 0, gen))  # generated tokens so far
        n_pages += 1
        pos += gen
        rows.append(entries)
    return rows, n_pages


def tables(rows, width, dev):
    t = torch.zeros((4, len(rows), width), dtype=torch.int32)
    for b, r in enumerate(rows):
        t[:, b, :len(r)] = torch.tensor(r, dtype=torch.int32).T
    return t.to(dev)


def copy_bandwidth(dev) -> float:
    import triton

    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), rep=100, return_mode="median")
    return 2 * (1 << 30) / (ms * 1e-3)


def breakdown(tk, var, rows, q, q_pos, k, v, t, inv):
    """Milliseconds of each part of one variant, alone (CUDA graphs; ``no_parts``: the merge
    reads no slot)."""
    import triton

    from lazyllm.kernels.grouping import plan_groups

    shape, nw, ns = var.split(":")
    mt, ppi = (int(x) for x in shape.split("x"))
    plan = plan_groups(rows, members_per_item=mt, pages_per_item=ppi)
    dev = q.device
    pt = plan.tensors(dev)
    empty = torch.zeros((0, 4), dtype=torch.int32, device=dev)
    no_own = torch.zeros_like(pt.own)
    po = torch.empty((plan.n_slots, HQ, D), device=dev, dtype=torch.float32)
    pl = torch.empty((plan.n_slots, HQ), device=dev, dtype=torch.float32)
    out = torch.empty_like(q)
    no_parts = torch.zeros_like(pt.parts)
    res = {}  # each case also runs the own-pages-and-merge launch, over nothing where emptied
    cases = {"all": (pt, True), "shared": (pt._replace(own=no_own, parts=no_parts), True),
             "own": (pt._replace(items=empty, parts=no_parts), True),
             "merge": (pt._replace(items=empty, own=no_own), True),
             "own_merge": (pt._replace(items=empty), True),
             "shared_norope": (pt._replace(own=no_own, parts=no_parts), False)}
    for name, (p, rope) in cases.items():
        def fn(p=p, rope=rope):
            tk.grouped_attention_triton(q, q_pos, k, v, t[0], t[1], t[2], t[3], inv, D ** -0.5, p, out,
                                        members_per_item=mt, part_o=po, part_lse=pl, num_warps=int(nw),
                                        num_stages=int(ns), use_rope=rope)
        fn()
        res[name] = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return res


def main():
    import triton

    from lazyllm.kernels.grouping import plan_groups
    from lazyllm.kernels.loader import triton_kernels

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--kinds", nargs="+", default=["shared", "own", "zipf"])
    ap.add_argument("--variants", nargs="+", default=["16x8:4:2", "16x8:4:3", "16x8:4:4", "16x8:8:2", "8x8:4:3",
                                                        "16x16:4:3", "16x4:4:3"],
                    help="MTxPPI:num_warps:num_stages")
    ap.add_argument("--breakdown", default=None, metavar="MTxPPI:W:S",
                    help="also time the parts of this variant alone: shared items, own items, the merge, "
                         "shared items without rotation")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    tk = triton_kernels()
    inv = llama3_inv_freq().to(dev)
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    out_rows = []
    for kind in args.kinds:
        for B in args.batch:
            rows, n_pages = build_step(kind, B)
            W = max(len(r) for r in rows)
            t = tables(rows, W, dev)
            g = torch.Generator(device=dev).manual_seed(0)
            k = torch.randn(n_pages + 1, PS, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(n_pages + 1, PS, HKV, D, device=dev, dtype=torch.bfloat16, generator=g)
            q = torch.randn(B, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
            q_pos = torch.tensor([r[-1][1] + r[-1][3] - 1 for r in rows], dtype=torch.int32, device=dev)
            cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
            rope = tk.rope_table(t[2], inv)
            out_old = torch.empty_like(q)

            def old():
                tk.paged_attention_triton(q, q_pos, cu, k, v, t[0], t[1], t[2], t[3], inv, D ** -0.5, out_old,
                                          max_seqlen_q=1, rope=rope, padding_finite=True)

            ms_old = triton.testing.do_bench_cudagraph(old, rep=50, return_mode="median")
            distinct = {e[0] for r in rows for e in r}
            uniq_bytes = sum(2 * HKV * D * 2 * e[3] for e in {e[0]: e for r in rows for e in r}.values())
            all_bytes = sum(2 * HKV * D * 2 * e[3] for r in rows for e in r)
            row = dict(kind=kind, batch=B, old_ms=ms_old, floor_unique_ms=uniq_bytes / bw * 1e3,
                       floor_all_ms=all_bytes / bw * 1e3, distinct_pages=len(distinct), variants={})
            for var in args.variants:
                shape, nw, ns = var.split(":")
                mt, ppi = (int(x) for x in shape.split("x"))
                t0 = time.perf_counter()
                plan = plan_groups(rows, members_per_item=mt, pages_per_item=ppi)
                plan_ms = (time.perf_counter() - t0) * 1e3
                if plan is None:
                    row["variants"][var] = None
                    continue
                pt = plan.tensors(dev)
                po = torch.empty((plan.n_slots, HQ, D), device=dev, dtype=torch.float32)
                pl = torch.empty((plan.n_slots, HQ), device=dev, dtype=torch.float32)
                out_new = torch.empty_like(q)

                def new(mt=mt, nw=int(nw), ns=int(ns)):
                    tk.grouped_attention_triton(q, q_pos, k, v, t[0], t[1], t[2], t[3], inv, D ** -0.5, pt, out_new,
                                                members_per_item=mt,
                                                part_o=po, part_lse=pl, num_warps=nw, num_stages=ns)

                try:
                    new()
                    old()
                    torch.cuda.synchronize()
                    err = (out_new.float() - out_old.float()).abs().max().item()
                    ms_new = triton.testing.do_bench_cudagraph(new, rep=50, return_mode="median")
                except Exception as e:  # noqa: BLE001 (a variant that does not compile: say so)
                    row["variants"][var] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
                    print(kind, B, var, "failed", e, flush=True)
                    continue
                row["variants"][var] = dict(ms=ms_new, max_abs_diff=err, items=plan.n_items,
                                            slots=plan.n_slots, plan_host_ms=plan_ms)
            if args.breakdown:
                row["breakdown"] = breakdown(tk, args.breakdown, rows, q, q_pos, k, v, t, inv)
                print("    breakdown", {n: round(x * 1e3, 1) for n, x in row["breakdown"].items()}, flush=True)
            best = min((v["ms"], k_) for k_, v in row["variants"].items() if v and "ms" in v) \
                if any(v and "ms" in v for v in row["variants"].values()) else (None, None)
            row["best"] = best[1]
            print(f"{kind:6s} B={B:4d} old {ms_old * 1e3:8.1f} us  "
                  f"floor(unique) {row['floor_unique_ms'] * 1e3:6.1f} us "
                  f"floor(all) {row['floor_all_ms'] * 1e3:7.1f} us  best {best[1]} "
                  f"{(best[0] or 0) * 1e3:8.1f} us", flush=True)
            for var, vr in row["variants"].items():
                if vr and "ms" in vr:
                    print(f"    {var:12s} {vr['ms'] * 1e3:8.1f} us  diff {vr['max_abs_diff']:.2e}  items {vr['items']} "
                          f"slots {vr['slots']} plan {vr['plan_host_ms']:.2f} ms", flush=True)
            out_rows.append(row)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_tbs=bw / 1e12, rows=out_rows), f, indent=1)


if __name__ == "__main__":
    main()
