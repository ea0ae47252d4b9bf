"""The projections of one decode step, alone: how close do the GEMM libraries, and our
split-K GEMV (``lazyllm.kernels.fused.gemv_parts``), get to the weight-read floor at small batch?

Replays, from one CUDA graph, the GEMMs of a Llama-3.1-8B decode step (per layer: fused
q/k/v, output, fused gate/up, down; then the LM head) with random bf16 weights, for each
batch size and each BLAS back end torch offers (``torch.backends.cuda.preferred_blas_library``:
cuBLAS, cuBLASLt), and prints the step time against the floor (every weight byte read once
at the measured copy bandwidth). Then, at batch 1, the GEMV in each configuration
``(BLOCK_N, BLOCK_K, warps)`` per projection (32 layers of it from one graph; its partial
sums are added by the next fused kernel in the engine, so no reduce is timed). GPU only.

    python3 benchmarks/gemm_probe.py [--batches 1,4,64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import copy_bandwidth  # noqa: E402

SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
LM_HEAD = ("lm_head", 128256, 4096)


def graph_time(fn, reps: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    layers = [{n: torch.randn(o, i, device="cuda", dtype=dt) * 0.02 for n, o, i in SHAPES} for _ in range(args.layers)]
    head = torch.randn(LM_HEAD[1], LM_HEAD[2], device="cuda", dtype=dt) * 0.02
    wbytes = sum(w.numel() * 2 for l in layers for w in l.values()) + head.numel() * 2
    bw = copy_bandwidth()
    floor_ms = wbytes / bw * 1e3
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, weights {wbytes / 1e9:.2f} GB, "
          f"floor {floor_ms:.3f} ms", flush=True)
    rows = []
    libs = ["cublas", "cublaslt"]
    for B in [int(b) for b in args.batches.split(",")]:
        x4 = torch.randn(B, 4096, device="cuda", dtype=dt)
        x14 = torch.randn(B, 14336, device="cuda", dtype=dt)

        def step():
            for l in layers:
                F.linear(x4, l["qkv"])
                F.linear(x4, l["o"])
                F.linear(x4, l["gate_up"])
                F.linear(x14, l["down"])
            F.linear(x4, head)

        for lib in libs:
            try:
                torch.backends.cuda.preferred_blas_library(lib)
                ms = graph_time(step)
                per = {}
                for n, o, i in SHAPES:
                    xx = x14 if n == "down" else x4
                    per[n] = graph_time(lambda: [F.linear(xx, l[n]) for l in layers])
                row = dict(batch=B, lib=lib, step_ms=ms, floor_ms=floor_ms, x_floor=ms / floor_ms,
                           **{f"{n}_ms": v for n, v in per.items()})
            except Exception as e:  # noqa: BLE001
                row = dict(batch=B, lib=lib, error=f"{type(e).__name__}: {e}"[:200])
            rows.append(row)
            print(json.dumps(row), flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    from lazyllm.kernels.fused import gemv_parts

    x4 = torch.randn(1, 4096, device="cuda", dtype=dt)
    x14 = torch.randn(1, 14336, device="cuda", dtype=dt)
    configs = [(16, 1024, 4), (32, 1024, 8), (32, 512, 4), (64, 512, 8), (16, 2048, 8), (64, 256, 4),
               (128, 256, 8), (8, 2048, 4), (64, 1024, 8), (32, 2048, 8)]
    # correctness first: the summed partials against F.linear in float32
    for n, o, i in SHAPES:
        xx = x14 if n == "down" else x4
        ref = F.linear(xx.float(), layers[0][n].float())
        for cfg in configs:
            err = (gemv_parts(xx, layers[0][n], cfg).sum(0) - ref).abs().max().item()
            assert err < 1e-2 * ref.abs().max().item(), (n, cfg, err)
    gemv = []
    for n, o, i in SHAPES:
        xx = x14 if n == "down" else x4
        best = None
        for cfg in configs:
            ms = graph_time(lambda: [gemv_parts(xx, l[n], cfg) for l in layers])
            gb = o * i * 2 * len(layers) / 1e9
            row = dict(shape=n, config=cfg, ms=ms, TBps=gb / ms, cublas_ms=next(
                r[f"{n}_ms"] for r in rows if r.get("batch") == 1 and r.get("lib") == "cublas"))
            gemv.append(row)
            print(json.dumps(row), flush=True)
            if best is None or ms < best["ms"]:
                best = row
        print(f"best for {n} ({o}x{i}): {best['config']} {best['ms']:.3f} ms ({best['TBps']:.2f} TB/s) "
              f"vs cuBLAS {best['cublas_ms']:.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_TBps": bw / 1e12, "rows": rows, "gemv": gemv},
                      f, indent=1)


if __name__ == "__main__":
    main()
