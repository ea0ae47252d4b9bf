"""Kernel benchmark: deferred-RoPE paged attention (Triton, and the Gluon prefill on Hopper)
against the strongest torch SDPA, one layer of Llama-3.1-8B attention (32 query heads, 8 KV
heads, head_dim 128) in bfloat16 on one GPU. Prints a table and writes ``kernels.json`` and
``kernels.md`` to ``--out``. The problems and the tables' code: ``benchmarks/attention/``.

    python3 benchmarks/kernel_bench.py --out DIR --page-size 64                    # prefill, decode, copy
    python3 benchmarks/kernel_bench.py --out DIR --page-size 64 --sections decode  # decode rows only
    python3 benchmarks/kernel_bench.py --out DIR --prefill-runs                    # also: where RoPE's cost goes
    python3 benchmarks/kernel_bench.py --out DIR --dry-run                         # CPU check of this script

What is measured
----------------
* Prefill: ``q`` new tokens of one sequence over ``kv`` keys in total: ``kv - q`` cached
  tokens in chunks of 448..576 tokens, each at a random nonzero delta, then the ``q``
  tokens' own pages (delta 0); page ids shuffled over the pool. Query ``i`` (at position
  ``kv - q + i``) sees ``kv - q + i + 1`` keys, so the causal-aware count is
  ``FLOPs = 4 * heads * head_dim * (q * (kv - q) + q * (q + 1) / 2)``. The launcher is
  called as the engine calls it (``padding_finite=True``), so on Hopper long prefills run
  the Gluon kernel; the row then also times the Triton prefill on the same call.
  SDPA runs the same logical problem on contiguous, already-rotated K/V through
  ``aten._scaled_dot_product_flash_attention`` with ``is_causal=True`` (bottom-right
  aligned for that op, the same mask), GQA native; and through the cuDNN backend, with
  the same causal mask (``causal_lower_right``) and without a mask, whose rate is counted
  on all ``q * kv`` pairs (``FLOPs = 4 * heads * head_dim * q * kv``): it does more work
  than the causal problem needs, but is SDPA's fastest kernel on an H200.
* Decode: ``batch`` sequences of ``kv`` keys each (chunked the same way), one query each.
  ``TB/s = bytes / time`` with ``bytes = K and V read once (batch * kv * 8 * 128 * 2 * 2)
  + q + out``; the same count for both kernels.
* Deferred-RoPE cost: the same kernel with ``use_rope=False`` (no rotation; all else
  equal). "ours" times build the step's cos/sin and runs tables in the call; "table
  prebuilt" times do not (an engine builds them once per step for all layers).
  ``--prefill-runs`` splits the prefill's cost into the rotation itself (every delta 0:
  one run) and the switches between runs of equal deltas, for the Gluon and the Triton
  prefill.
* CUDA graphs: prefill and decode also replayed from one CUDA graph (tables prebuilt), as
  the engine runs them: the GPU time without the Python launcher's gaps; each side is timed
  twice, interleaved, and the lower reading kept.
* Re-rotation copy (the Block-Attention baseline's per-request copy): 32 layers x 256 pages
  of ``--page-size`` tokens, bytes read + written, against ``torch`` copying the same number
  of bytes device to device, and against a naive torch re-rotation.

Times are ``triton.testing.do_bench`` medians (it flushes L2 before every run) or, for the
graph rows, medians of CUDA-graph replays. Before timing, every configuration is checked
against ``reference.paged_attention_ref`` on float32-upcast inputs (a slice of the
queries; pages compacted), and against SDPA.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

DRY = "--dry-run" in sys.argv  # CPU, Triton's interpreter, tiny shapes: checks this script
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

# imported once TRITON_INTERPRET is set
import _common  # noqa: E402, F401  (the repository root on sys.path: benchmarks/_common.py)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.attention import HKV, HQ, D  # noqa: E402, F401
from benchmarks.attention.problems import (  # noqa: E402
    DTYPE,
    SCALE,
    Paged,
    compact_upcast,
    llama3_inv_freq,
    sdpa_flash,
)
from benchmarks.attention.report import derived, fmt_row, markdown  # noqa: E402, F401  (tests reach them here)
from lazyllm.kernels import reference as ref  # noqa: E402
from lazyllm.kernels.loader import triton_kernels  # noqa: E402
from lazyllm.kernels.options import KernelOptions  # noqa: E402

ta = triton_kernels(interpret=DRY)
TRITON_PREFILL = KernelOptions(prefill_kernel="triton")  # the Triton prefill where Gluon would serve

PREFILL = [(64, 4096), (64, 8192), (64, 32768), (512, 4096), (512, 8192), (512, 32768),
           (2048, 4096), (2048, 8192), (2048, 32768)]
DECODE = [(1, 4096), (1, 16384), (1, 32768), (8, 16384), (32, 4096), (32, 16384), (32, 32768),
          (64, 4096), (64, 16384), (64, 32768),
          (128, 4096), (128, 16384), (128, 32768)]


def log(*a):
    print(*a, flush=True)


def bench(fn, warmup=10, rep=60):
    if DRY:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_graph(fn, rep=40):
    """Median over replays of one CUDA graph of many calls (no launch gaps; L2 not flushed)."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def bench_interleaved(calls, rounds):
    """Times each of ``calls`` (key -> function; from CUDA graphs) in turn, ``rounds`` times
    over, and returns the lowest reading of each (key -> ms), so a slow spell of the GPU
    does not fall on one side of a comparison only."""
    best = {}
    for _ in range(rounds):
        for key, fn in calls.items():
            t = bench_graph(fn) if not DRY else bench(fn)
            best[key] = min(best.get(key, t), t)
    return best


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def relerr(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()



# ----------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------


def copy_bandwidth(dev):
    n = 1 << 30 if not DRY else 1 << 16  # 2 GiB of bf16
    src = torch.randn(n, device=dev, dtype=DTYPE)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e9, ms  # TB/s (read + write)


def release():
    """Hands the freed blocks of the last case back to the device before the next shape."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sdpa_cudnn(q, k, v, causal):
    """SDPA's cuDNN backend, GQA native; ``causal``: bottom-right aligned
    (``causal_lower_right``), the same mask as ``sdpa_flash``. Layouts as ``sdpa_flash``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2]) if causal else None
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True)


def run_cudnn(qs, k, v, s_out):
    """SDPA cuDNN's times for a prefill row: the causal problem (checked against the flash
    output) and the same shape unmasked, each under ``do_bench`` and from a CUDA graph (as
    ours is timed; the tables take the faster reading); none in the dry run."""
    row = {}
    if DRY:
        return row
    try:
        row["err_cudnn"] = relerr(sdpa_cudnn(qs, k, v, True), s_out)
        row["ms_cudnn"] = bench(lambda: sdpa_cudnn(qs, k, v, True))
        row["ms_cudnn_nomask"] = bench(lambda: sdpa_cudnn(qs, k, v, False))
        row["ms_cudnn_graph"] = bench_graph(lambda: sdpa_cudnn(qs, k, v, True))
        row["ms_cudnn_nomask_graph"] = bench_graph(lambda: sdpa_cudnn(qs, k, v, False))
    except Exception as e:  # no cuDNN attention in this build: the row keeps the rest
        row["cudnn_error"] = repr(e)[:200]
    return row


def prefill_case(nq, kv, ps, inv_freq, dev, seed=0):
    """One sequence of ``kv`` keys whose last ``nq`` are new; ``qs`` in SDPA's layout
    ``(1, HQ, nq, D)``, ``q`` the kernel's."""
    pg = Paged(1, kv, nq, ps, inv_freq, seed=seed, dev=dev, dtype=DTYPE)
    torch.manual_seed(seed + 1)
    qs = torch.randn(1, HQ, nq, D, device=dev, dtype=DTYPE)  # SDPA layout
    q = qs[0].transpose(0, 1).contiguous()  # (nq, HQ, D)
    q_pos = torch.arange(kv - nq, kv, device=dev, dtype=torch.int64)
    cu = torch.tensor([0, nq], device=dev, dtype=torch.int32)
    return pg, qs, q, q_pos, cu


def decode_case(batch, kv, ps, inv_freq, dev):
    """``batch`` sequences of ``kv`` keys (16 of their own), one query each at the last
    position; ``qs`` in SDPA's layout ``(batch, HQ, 1, D)``, ``q`` the kernel's."""
    pg = Paged(batch, kv, 16, ps, inv_freq, seed=batch * 7 + kv, dev=dev, dtype=DTYPE)
    torch.manual_seed(3)
    qs = torch.randn(batch, HQ, 1, D, device=dev, dtype=DTYPE)
    q = qs[:, :, 0].contiguous()  # (batch, HQ, D)
    q_pos = torch.full((batch,), kv - 1, device=dev, dtype=torch.int64)
    cu = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    return pg, qs, q, q_pos, cu


def decode_ref(pg, q, q_pos, cu, c):
    """The float32 reference for the first ``c`` sequences (pages compacted)."""
    return ref.paged_attention_ref(**compact_upcast(pg.args(q[:c], q_pos[:c], cu[:c + 1], rows=slice(0, c))))


def check_prefill(pg, qs, q, q_pos, cu, out, sdpa_out, n_check=64):
    """Relative errors of a prefill output: its last ``n_check`` rows against the float32
    reference, and all of it against SDPA's output (NaN without one)."""
    nq = q.shape[0]
    c = min(n_check, nq)
    a = pg.args(q[nq - c:], q_pos[nq - c:], torch.tensor([0, c], device=q.device, dtype=torch.int32))
    r = ref.paged_attention_ref(**compact_upcast(a))
    e_ref = relerr(out[nq - c:], r)
    e_sdpa = relerr(out, sdpa_out[0].transpose(0, 1)) if sdpa_out is not None else float("nan")
    return e_ref, e_sdpa


_GLUON_CALLS = [0]


def _count_gluon_calls():
    """Counts launches of the Gluon prefill (to report which kernel served a call)."""
    try:
        gp = importlib.import_module(f"{ta.__name__}.gluon_prefill")
    except Exception:  # noqa: BLE001  (no Gluon in this triton)
        return
    real = gp.paged_prefill_gluon

    def counted(*a, **k):
        _GLUON_CALLS[0] += 1
        return real(*a, **k)

    gp.paged_prefill_gluon = counted


def run_prefill(nq, kv, ps, inv_freq, dev):
    """One prefill row: the default launch as the engine calls it, RoPE on and off, with the
    tables built in the call and prebuilt, from CUDA graphs, against SDPA (flash and cuDNN);
    where the Gluon kernel served the call, the Triton prefill too."""
    pg, qs, q, q_pos, cu = prefill_case(nq, kv, ps, inv_freq, dev)
    k_sdpa, v_sdpa = pg.k_sdpa, pg.v_sdpa
    a = pg.args(q, q_pos, cu)
    out = torch.empty_like(q)
    pairs = nq * (kv - nq) + nq * (nq + 1) / 2
    flops = 4 * HQ * D * pairs
    s_out = sdpa_flash(qs, k_sdpa, v_sdpa, True)
    s_ms = bench(lambda: sdpa_flash(qs, k_sdpa, v_sdpa, True))
    cud = run_cudnn(qs, k_sdpa, v_sdpa, s_out)
    # config, splits, extra: the launch choices, always the defaults here (kept in the row so
    # that its keys match earlier runs' JSON)
    row = dict(kind="prefill", q=nq, kv=kv, page_size=ps, config=None, splits=None, flops=flops, extra=None, **cud)
    kw = dict(out=out, max_seqlen_q=nq, padding_finite=True)
    try:
        out.fill_(float("nan"))
        n0 = _GLUON_CALLS[0]
        ta.paged_attention_triton(**a, **kw)
        sync()
        row["kernel"] = "gluon" if _GLUON_CALLS[0] > n0 else "triton"
        row["nan"] = bool(torch.isnan(out).any())
        row["err_ref"], row["err_sdpa"] = check_prefill(pg, qs, q, q_pos, cu, out, s_out)
        row["ms_rope"] = bench(lambda: ta.paged_attention_triton(**a, **kw))
        row["ms_norope"] = bench(lambda: ta.paged_attention_triton(**a, use_rope=False, **kw))
        rt = ta.rope_table(pg.block_delta, inv_freq)
        row["ms_rope_pretable"] = bench(lambda: ta.paged_attention_triton(**a, rope=rt, **kw))
        if row["kernel"] == "gluon":
            row["ms_triton_pretable"] = bench(lambda: ta.paged_attention_triton(
                **a, rope=rt, options=TRITON_PREFILL, **kw))
            row["ms_triton_norope"] = bench(lambda: ta.paged_attention_triton(
                **a, use_rope=False, options=TRITON_PREFILL, **kw))
        if not DRY:
            # each side twice, interleaved: the two readings of each side bound the noise
            for rnd in ("", "2"):
                row["ms_rope_graph" + rnd] = bench_graph(lambda: ta.paged_attention_triton(**a, rope=rt, **kw))
                row["ms_norope_graph" + rnd] = bench_graph(lambda: ta.paged_attention_triton(
                    **a, use_rope=False, **kw))
            row["ms_sdpa_graph"] = bench_graph(lambda: sdpa_flash(qs, k_sdpa, v_sdpa, True))
    except Exception as e:  # keep the rest of the run
        row["error"] = repr(e)[:300]
        traceback.print_exc()
    row["ms_sdpa"] = s_ms
    log(fmt_row(row))
    return [row]


def run_prefill_runs(nq, kv, inv_freq, dev, kernels=("gluon", "triton"), rounds=3):
    """Where the default prefill's deferred-RoPE cost goes, from CUDA graphs (pages of 64,
    tables prebuilt, ``padding_finite=True``): the real deltas (a run of equal deltas per
    chunk), every delta 0 (RoPE on, one run: the rotation done once), and RoPE off; each
    kernel of ``kernels`` (``prefill_kernel=``), all timed in turn ``rounds`` times, the
    lowest reading of each kept. ``(real - one run) / (runs - 1)`` is the cost of a run."""
    pg, qs, q, q_pos, cu = prefill_case(nq, kv, 64, inv_freq, dev)
    a = pg.args(q, q_pos, cu)
    a0 = dict(a, block_delta=torch.zeros_like(pg.block_delta))
    rt = ta.rope_table(pg.block_delta, inv_freq)
    rt0 = ta.rope_table(a0["block_delta"], inv_freq)
    out = torch.empty_like(q)
    runs = int((pg.block_delta[:, 1:] != pg.block_delta[:, :-1]).sum()) + 1
    row = dict(kind="prefill_runs", q=nq, kv=kv, runs=runs)
    calls = {}
    for kern in kernels:
        kw = dict(out=out, max_seqlen_q=nq, padding_finite=True, options=KernelOptions(prefill_kernel=kern))
        calls[(kern, "real")] = (lambda kw=kw: ta.paged_attention_triton(**a, rope=rt, **kw))
        calls[(kern, "one_run")] = (lambda kw=kw: ta.paged_attention_triton(**a0, rope=rt0, **kw))
        calls[(kern, "off")] = (lambda kw=kw: ta.paged_attention_triton(**a, use_rope=False, **kw))
    try:
        for fn in calls.values():
            fn()
        sync()
        for (kern, what), t in bench_interleaved(calls, rounds).items():
            row[f"ms_{kern}_{what}"] = t
    except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
        traceback.print_exc()
        log(f"prefill runs q={nq} kv={kv} ERROR {row['error']}")
        return [row]
    for kern in kernels:
        real, one, off = (row[f"ms_{kern}_{w}"] for w in ("real", "one_run", "off"))
        log(f"prefill runs q={nq:5d} kv={kv:6d} {kern:6s} runs {runs:3d} | real {real:.4f} one run {one:.4f} "
            f"off {off:.4f} ms | RoPE {100 * (real / off - 1):+.1f}% = one run {100 * (one / off - 1):+.1f}% + runs "
            f"{100 * (real - one) / off:+.1f}% ({1e3 * (real - one) / max(runs - 1, 1):.2f} us a run)")
    return [row]


def run_decode(batch, kv, ps, inv_freq, dev, n_check=2):
    """One decode row: the default launch, RoPE on and off, with the cos/sin table built in
    the call and prebuilt, from CUDA graphs, against SDPA (flash)."""
    pg, qs, q, q_pos, cu = decode_case(batch, kv, ps, inv_freq, dev)
    k_sdpa, v_sdpa = pg.k_sdpa, pg.v_sdpa
    a = pg.args(q, q_pos, cu)
    out = torch.empty_like(q)
    nbytes = batch * kv * HKV * D * 2 * 2 + 2 * q.numel() * 2
    s_out = sdpa_flash(qs, k_sdpa, v_sdpa, False)[:, :, 0]
    s_ms = bench(lambda: sdpa_flash(qs, k_sdpa, v_sdpa, False))
    c = min(n_check, batch)
    r = decode_ref(pg, q, q_pos, cu, c)
    # config, splits, extra: as in run_prefill
    row = dict(kind="decode", batch=batch, kv=kv, page_size=ps, config=None, splits=None, bytes=nbytes, extra=None)
    kw = dict(out=out, max_seqlen_q=1)
    try:
        out.fill_(float("nan"))
        ta.paged_attention_triton(**a, **kw)
        sync()
        row["nan"] = bool(torch.isnan(out).any())
        row["err_ref"] = relerr(out[:c], r)
        row["err_sdpa"] = relerr(out, s_out)
        row["ms_rope"] = bench(lambda: ta.paged_attention_triton(**a, **kw))
        row["ms_norope"] = bench(lambda: ta.paged_attention_triton(**a, use_rope=False, **kw))
        rt = ta.rope_table(pg.block_delta, inv_freq)
        row["ms_rope_pretable"] = bench(lambda: ta.paged_attention_triton(**a, rope=rt, **kw))
        if not DRY:  # as the engine runs decode: one CUDA graph, no launch gaps
            # each side twice, interleaved, the lower reading kept (as for prefill)
            cudnn = None
            try:  # SDPA's cuDNN backend: PyTorch's default for this decode shape, and its fastest
                row["err_cudnn"] = relerr(sdpa_cudnn(qs, k_sdpa, v_sdpa, False)[:, :, 0], s_out)
                cudnn = lambda: sdpa_cudnn(qs, k_sdpa, v_sdpa, False)  # noqa: E731
            except Exception as e:  # no cuDNN attention in this build: the row keeps the rest
                row["cudnn_error"] = repr(e)[:200]
            for rnd in ("", "2"):
                row["ms_rope_graph" + rnd] = bench_graph(lambda: ta.paged_attention_triton(**a, rope=rt, **kw))
                row["ms_norope_graph" + rnd] = bench_graph(lambda: ta.paged_attention_triton(
                    **a, use_rope=False, **kw))
                if cudnn is not None:
                    row["ms_cudnn_graph" + rnd] = bench_graph(cudnn)
            row["ms_sdpa_graph"] = bench_graph(lambda: sdpa_flash(qs, k_sdpa, v_sdpa, False))
    except Exception as e:
        row["error"] = repr(e)[:300]
        traceback.print_exc()
    row["ms_sdpa"] = s_ms
    log(fmt_row(row))
    return [row]


def run_copy(inv_freq, dev, copy_tbs, n_layers=32, ps=16, n=256):
    """Re-rotate ``n`` pages in each of ``n_layers`` layers (the default launch)."""
    torch.manual_seed(5)
    n_pages = 2 * n + 16
    k = torch.randn(n_layers, n_pages, ps, HKV, D, device=dev, dtype=DTYPE)
    v = torch.randn_like(k)
    perm = torch.randperm(n_pages, device=dev)
    src, dst = perm[:n].to(torch.int32), perm[n:2 * n].to(torch.int32)
    delta = torch.randint(1, 32768, (n,), device=dev, dtype=torch.int32)
    nbytes = 2 * 2 * n_layers * n * ps * HKV * D * 2  # K and V, read + write
    kr, vr = k.clone(), v.clone()
    ref.rerotate_copy_ref(kr, vr, src, dst, delta, inv_freq)
    flat_src = torch.empty(nbytes // 4, device=dev, dtype=DTYPE)  # same bytes, one copy
    flat_dst = torch.empty_like(flat_src)
    ms_copy = bench(lambda: flat_dst.copy_(flat_src))
    ms_ref = bench(lambda: ref.rerotate_copy_ref(k, v, src, dst, delta, inv_freq))
    # block_rows, num_warps: the launch configuration, the default here (None)
    row = dict(kind="rerotate", layers=n_layers, pages=n, page_size=ps, bytes=nbytes, block_rows=None,
               num_warps=None, ms_torch_copy=ms_copy, ms_ref=ms_ref, copy_ceiling_tbs=copy_tbs)
    try:
        k2, v2 = k.clone(), v.clone()
        ta.rerotate_copy_triton(k2, v2, src, dst, delta, inv_freq)
        row["err_k"] = relerr(k2[:, dst.long()], kr[:, dst.long()])
        row["v_equal"] = bool(torch.equal(v2[:, dst.long()], vr[:, dst.long()]))
        row["ms"] = bench(lambda: ta.rerotate_copy_triton(k2, v2, src, dst, delta, inv_freq))
    except Exception as e:
        row["error"] = repr(e)[:300]
        traceback.print_exc()
    log(fmt_row(row))
    return [row]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for kernels.json and kernels.md")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sections", default="prefill,decode,copy", help="comma separated: prefill, decode, copy")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--prefill-runs", action="store_true",
                    help="prefill at q >= 512 from CUDA graphs, Gluon and Triton: real deltas, every delta 0 (one "
                         "run) and RoPE off, to split the RoPE cost into its fixed part and its cost per run")
    ap.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny shapes: checks the script")
    args = ap.parse_args()
    global DTYPE, PREFILL, DECODE
    if DRY:
        DTYPE = torch.float16
        PREFILL, DECODE = [(16, 600), (40, 700)], [(1, 700), (3, 1200)]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cpu" if DRY else "cuda")
    if not DRY:
        _count_gluon_calls()
    t0 = time.time()
    copy_tbs, _ = copy_bandwidth(dev)
    meta = dict(device=torch.cuda.get_device_name() if not DRY else "cpu (dry run)", torch=torch.__version__,
                triton=triton.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                page_size=args.page_size, copy_tbs=copy_tbs, python=platform.python_version(),
                command=" ".join(["python3"] + sys.argv))
    log(f"{meta['device']} torch {meta['torch']} triton {meta['triton']} copy {copy_tbs:.2f} TB/s")
    inv_freq = llama3_inv_freq().to(dev)
    ps = args.page_size
    rows = []
    sections = args.sections.split(",")

    def save():
        (out_dir / "kernels.json").write_text(json.dumps(dict(meta=meta, rows=[derived(r) for r in rows]), indent=1))
        (out_dir / "kernels.md").write_text(markdown(meta, rows))

    pre = PREFILL if not args.quick else [(512, 8192)]
    dec = DECODE if not args.quick else [(32, 16384)]
    if "prefill" in sections:
        for nq, kv in pre:
            rows += run_prefill(nq, kv, ps, inv_freq, dev)
            release()
        save()
    if "decode" in sections:
        for b, kv in dec:
            rows += run_decode(b, kv, ps, inv_freq, dev)
            release()
        save()
    if args.prefill_runs:
        for nq, kv in ([s_ for s_ in PREFILL if s_[0] >= 512] if not DRY else ((40, 700),)):
            rows += run_prefill_runs(nq, kv, inv_freq, dev, kernels=("triton",) if DRY else ("gluon", "triton"),
                                     rounds=1 if DRY else 3)
            release()
            save()
    if "copy" in sections:
        rows += run_copy(inv_freq, dev, copy_tbs, ps=ps, **(dict(n_layers=2, n=4) if DRY else {}))
        save()
    log(f"done in {time.time() - t0:.0f}s")
    compiled_report()
    log(markdown(meta, rows))


def compiled_report():
    """Registers, spills and shared memory of every compiled attention kernel."""
    try:
        for fn in (ta.prefill._paged_attn_fwd, ta.copy_kv._rerotate_copy):
            for c, kern in ta.compiled_kernels(fn):
                key = {k: c.get(k) for k in ("BLOCK_M", "BLOCK_N", "USE_ROPE", "SCAN", "SPLIT_OUT", "PAGE_SIZE",
                                             "CS_PER_PAGE", "BLOCK_R", "QROT")} if c else ""
                log(f"{fn.__name__} {key} warps={kern.metadata.num_warps} stages={kern.metadata.num_stages} "
                    f"regs={kern.n_regs} spills={kern.n_spills} smem={kern.metadata.shared}")
    except Exception as e:  # diagnostics only
        log(f"compiled_report: {e!r}")


if __name__ == "__main__":
    main()
