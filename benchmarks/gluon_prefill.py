"""The warp-specialized Gluon prefill against the Triton prefill and SDPA (flash), on the
prefill shapes of ``benchmarks/kernel_bench.py`` at q >= 512 (Llama-3.1-8B heads, bf16, pages of
64, chunks of 448-576 tokens at random deltas; tables prebuilt, as an engine builds them
once per step). For each Gluon configuration: its error against the float32 reference,
its time with RoPE and with RoPE off (the deferred-RoPE cost), and its time against the
Triton kernel's default prefill and SDPA.

    python3 benchmarks/gluon_prefill.py --out OUT_DIR

Needs a Hopper GPU; writes ``gluon_prefill.json`` and ``gluon_prefill.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import sibling  # noqa: E402


def markdown(meta, rows, md_table) -> list[str]:
    """The table of ``gluon_prefill.md`` (``md_table``: ``benchmarks/kernel_bench.py``'s)."""
    return md_table(
        f"Device: {meta['device']}; torch {meta['torch']}; {meta['date']}; pages of 64, tables prebuilt.",
        ["q", "kv", "config", "Gluon ms", "TFLOP/s", "RoPE off ms", "RoPE cost", "of SDPA (flash)",
         "Triton prefill ms", "Gluon / Triton time", "rel err vs ref"],
        [[r["q"], r["kv"], r["config"], f"error: {r['error'][:80]}"] if "error" in r else
         [r["q"], r["kv"], r["config"], f"{r['ms_rope']:.3f}", f"{r['flops'] / r['ms_rope'] / 1e9:.0f}",
          f"{r['ms_off']:.3f}", f"{100 * (r['ms_rope'] / r['ms_off'] - 1):+.1f}%",
          f"{100 * r['ms_sdpa'] / r['ms_rope']:.0f}%",
          f"{r['ms_triton']:.3f}", f"{r['ms_rope'] / r['ms_triton']:.2f}", f"{r['err_ref']:.1e}"] for r in rows],
        align=["---:", "---:", "---"] + ["---:"] * 8)[:-1]  # no blank line at the end of the file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", default="128:4:2,128:4:3", help="BLOCK_M:warps per consumer:stages, comma separated")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        sys.exit("gluon_prefill.py needs a Hopper GPU (sm_90)")
    kb = sibling("kernel_bench")
    ta = kb.ta
    gp = importlib.import_module(f"{ta.__name__}.gluon_prefill")
    triton_prefill = kb.TRITON_PREFILL

    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    inv = kb.llama3_inv_freq().cuda()
    rows, t0 = [], time.time()
    for nq, kv in [s for s in kb.PREFILL if s[0] >= 512]:
        pg, qs, q, q_pos, cu = kb.prefill_case(nq, kv, 64, inv, "cuda")
        a = pg.args(q, q_pos, cu)
        rt = ta.rope_table(pg.block_delta, inv)
        s_out = kb.sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True)
        out = torch.empty_like(q)
        base = dict(q=nq, kv=kv, flops=4 * kb.HQ * kb.D * (nq * (kv - nq) + nq * (nq + 1) / 2))
        tri = (lambda: ta.paged_attention_triton(**a, out=out, max_seqlen_q=nq, rope=rt, options=triton_prefill),
               lambda: ta.paged_attention_triton(**a, out=out, max_seqlen_q=nq, use_rope=False, options=triton_prefill),
               lambda: kb.sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True))
        for f in tri:  # compiled before timing, and the clocks up after the compiles
            f()
        kb.bench(tri[0])
        base["ms_triton"], base["ms_triton_off"], base["ms_sdpa"] = (kb.bench(f) for f in tri)
        for cfg in configs:
            r = dict(base, config=cfg)
            try:
                def run(rope=True):
                    return gp.paged_prefill_gluon(**a, out=out, max_seqlen_q=nq, padding_finite=True, runs=rt[2],
                                                  use_rope=rope, config=cfg)
                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                r["nan"] = bool(torch.isnan(out).any())
                r["err_ref"], r["err_sdpa"] = kb.check_prefill(pg, qs, q, q_pos, cu, out, s_out)
                run(False)  # compiled too; then the clocks, idle during the compiles, are brought back up
                t_warm = time.time()
                while time.time() - t_warm < (2.0 if not rows else 0.2):
                    run()
                torch.cuda.synchronize()
                kb.bench(run)
                # RoPE on and off timed in turn, twice; the lower of each (clock drift between
                # the two figures would otherwise show up as RoPE cost)
                ts = [(kb.bench(run), kb.bench(lambda: run(False))) for _ in range(2)]
                r["ms_rope"], r["ms_off"] = min(t[0] for t in ts), min(t[1] for t in ts)
                kb.log(f"q={nq} kv={kv} {cfg}: gluon {r['ms_rope']:.4f} ms, RoPE off {r['ms_off']:.4f} "
                       f"({100 * (r['ms_rope'] / r['ms_off'] - 1):+.1f}%) | triton {r['ms_triton']:.4f} "
                       f"(off {r['ms_triton_off']:.4f}) | sdpa {r['ms_sdpa']:.4f} | err ref {r['err_ref']:.1e} "
                       f"nan={r['nan']}")
            except Exception as e:  # keep the rest of the run
                r["error"] = repr(e)[:300]
                kb.log(f"q={nq} kv={kv} {cfg}: ERROR {e!r:.300}")
            rows.append(r)
        pg = None
        torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gluon_prefill.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    L = markdown(meta, rows, kb.md_table)
    (out_dir / "gluon_prefill.md").write_text("\n".join(L) + "\n")
    print("\n".join(L))
    kb.log(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
