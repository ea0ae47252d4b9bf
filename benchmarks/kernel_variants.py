"""Time copies of the attention kernel file side by side on the GPU (prefill at q >= 512,
optionally decode at batch >= 32).

Each variant is a copy of ``kernels/triton_attention.py`` with one change (a different loop,
a different rotation); this loads every copy as its own module and, for each prefill shape
of ``benchmarks/kernels.py`` at q >= 512, runs ``run_prefill_diag`` on each (the real deltas,
every delta 0 so there is a single run, RoPE off, SDPA; error against the reference),
variants interleaved shape by shape so clock drift hits them alike. Optionally the same
with float16 caches, and (``--decode``) the decode shapes at batch >= 32 (``run_decode``
on pages of 64, timed under ``do_bench`` and replayed from CUDA graphs). This is how the
variant rows of BENCHMARKS.md ("Kernels (issue 3)") were measured; the variant files
themselves are scratch copies, described there.

    python3 benchmarks/kernel_variants.py --out DIR path/to/copy_a.py[:stages] path/to/copy_b.py ...

``:stages`` (default 2) sets the pipeline stages of the 64x64, 4-warp tile;
``:stages:block_m:warps`` also the query tile and warps (e.g. ``copy.py:2:128:8``). Writes
``DIR/variants.json``; prints one line per (shape, variant). ``--dry-run``: CPU, Triton's
interpreter, tiny shapes (checks this script).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", help="kernel file copies, each optionally ':stages[:block_m:warps]'")
    ap.add_argument("--out", required=True)
    ap.add_argument("--fp16", action="store_true", help="also q=512/4k and 2048/8k with float16 caches")
    ap.add_argument("--decode", action="store_true", help="also decode at batch >= 32 (pages of 64, CUDA graphs)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill shapes")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes")
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("kernel_variants.py needs a CUDA GPU (or --dry-run)")
    kb = _load(HERE / "kernels.py", "_lazyllm_bench_kernels")  # reads --dry-run from sys.argv
    if args.dry_run:
        kb.DTYPE = torch.float16
        kb.PREFILL = [(512, 700)]
        kb.DECODE = [(32, 700)]
    specs = []
    for i, v in enumerate(args.variants):
        path, *opt = v.split(":")
        st, bm, nw = (int(x) for x in (opt + ["2", "64", "4"][len(opt):]))
        # a tile other than the default 64x64, 4 warps, 2 stages is named: one copy may be
        # timed at several tiles
        name = Path(path).stem + ("" if (bm, nw, st) == (64, 4, 2) else f"_{bm}x{nw}_s{st}")
        specs.append((name, _load(Path(path), f"_lazyllm_variant_{i}"), (bm, 64, nw, st)))
    dev = torch.device("cpu" if args.dry_run else "cuda")
    inv_freq = kb.llama3_inv_freq().to(dev)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.time()

    def dtype_name():
        return str(kb.DTYPE).split(".")[-1]

    def run(shapes):
        dtype = dtype_name()
        for nq, kv in shapes:
            for name, mod, cfg in specs:
                kb.ta = mod  # run_prefill_diag launches kb.ta.paged_attention_triton
                used = None if args.dry_run else cfg  # the dry run takes the launcher's default tile
                kb.log(f"-- {name} config={used} {dtype}")
                for r in kb.run_prefill_diag(nq, kv, inv_freq, dev, 3, used):
                    rows.append(dict(r, variant=name, stages=cfg[3], dtype=dtype))
            (out / "variants.json").write_text(json.dumps(rows, indent=1))

    def run_dec(shapes):
        for b, kv in shapes:
            for name, mod, _ in specs:
                kb.ta = mod
                kb.log(f"-- {name} decode")
                for r in kb.run_decode(b, kv, 64, inv_freq, dev, graphs=True):
                    rows.append(dict(r, variant=name, dtype=dtype_name()))
            (out / "variants.json").write_text(json.dumps(rows, indent=1))

    if not args.no_prefill:
        run([s for s in kb.PREFILL if s[0] >= 512])
    if args.decode:
        run_dec([s for s in kb.DECODE if s[0] >= 32])
    if args.fp16:
        kb.DTYPE = torch.float16
        run(((512, 4096), (2048, 8192)) if not args.dry_run else ((512, 700),))
    kb.log(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
