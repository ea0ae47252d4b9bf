"""Kernel benchmark: deferred-RoPE paged attention (Triton, and the Gluon prefill on Hopper)
against the strongest torch SDPA, one layer of Llama-3.1-8B attention (32 query heads, 8 KV
heads, head_dim 128) in bfloat16 on one GPU. Prints a table and writes ``kernels.json`` and
``kernels.md`` to ``--out``.

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
import math
import os
import platform
import random
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

from lazyllm.kernels import reference as ref  # noqa: E402
from lazyllm.kernels.loader import triton_kernels  # noqa: E402
from lazyllm.kernels.options import KernelOptions  # noqa: E402

ta = triton_kernels(interpret=DRY)
TRITON_PREFILL = KernelOptions(prefill_kernel="triton")  # the Triton prefill where Gluon would serve

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
SCALE = D ** -0.5
PREFILL = [(64, 4096), (64, 8192), (64, 32768), (512, 4096), (512, 8192), (512, 32768),
           (2048, 4096), (2048, 8192), (2048, 32768)]
DECODE = [(1, 4096), (1, 16384), (1, 32768), (8, 16384), (32, 4096), (32, 16384), (32, 32768),
          (64, 4096), (64, 16384), (64, 32768),
          (128, 4096), (128, 16384), (128, 32768)]


def log(*a):
    print(*a, flush=True)


def llama3_inv_freq(dim=128, theta=500000.0, factor=8.0, low=1.0, high=4.0, orig=8192):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = orig / low, orig / high
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    mid = (wavelen <= low_wl) & (wavelen >= high_wl)
    scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return scaled.to(torch.float32)


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
# problems
# ----------------------------------------------------------------------------------------


class Paged:
    """Sequences laid out in a shuffled page pool, and the same keys contiguous for SDPA.

    SDPA-side K/V (``(batch, HKV, kv, D)``, keys at their final positions) are drawn first;
    the cache stores each cached chunk's keys rotated back by its delta (as if encoded
    alone), own tokens as they are. So both kernels see the same logical keys."""

    def __init__(self, batch, kv, n_own, page_size, inv_freq, seed=0, dev="cuda"):
        g = random.Random(seed)
        torch.manual_seed(seed)
        self.batch, self.kv, self.page_size = batch, kv, page_size
        self.k_sdpa = torch.randn(batch, HKV, kv, D, device=dev, dtype=DTYPE)
        self.v_sdpa = torch.randn(batch, HKV, kv, D, device=dev, dtype=DTYPE)
        rows = []
        for _ in range(batch):
            segs, pos = [], 0
            while pos < kv - n_own:
                n = min(g.randint(448, 576), kv - n_own - pos)
                segs.append((pos, n, g.randint(1, 32768)))
                pos += n
            segs.append((pos, kv - pos, 0))
            rows.append(segs)
        n_pages = sum(math.ceil(n / page_size) for segs in rows for _, n, _ in segs)
        perm = torch.randperm(n_pages + 7, device="cpu")[:n_pages].tolist()
        max_blocks = max(sum(math.ceil(n / page_size) for _, n, _ in segs) for segs in rows)
        bt = torch.zeros(batch, max_blocks, dtype=torch.int32)
        bpos = torch.zeros_like(bt)
        bdelta = torch.zeros_like(bt)
        blen = torch.zeros_like(bt)
        slot_of_token = torch.empty(batch, kv, dtype=torch.int64)
        delta_of_token = torch.empty(batch, kv, dtype=torch.int64)
        nxt = 0
        for b, segs in enumerate(rows):
            j = 0
            for start, n, delta in segs:
                for off in range(0, n, page_size):
                    m = min(page_size, n - off)
                    p = perm[nxt]
                    nxt += 1
                    bt[b, j], bpos[b, j], bdelta[b, j], blen[b, j] = p, start + off, delta, m
                    slot_of_token[b, start + off:start + off + m] = p * page_size + torch.arange(m)
                    j += 1
                delta_of_token[b, start:start + n] = delta
        self.k_cache = torch.randn(n_pages + 7, page_size, HKV, D, device=dev, dtype=DTYPE)
        self.v_cache = torch.randn_like(self.k_cache)
        kf, vf = self.k_cache.view(-1, HKV, D), self.v_cache.view(-1, HKV, D)
        for b in range(batch):
            k_tok = self.k_sdpa[b].transpose(0, 1)  # (kv, HKV, D)
            k_tok = ref.rotate_by_delta(k_tok, -delta_of_token[b].to(dev), inv_freq)
            idx = slot_of_token[b].to(dev)
            kf.index_copy_(0, idx, k_tok)
            vf.index_copy_(0, idx, self.v_sdpa[b].transpose(0, 1))
        self.block_table, self.block_pos = bt.to(dev), bpos.to(dev)
        self.block_delta, self.block_len = bdelta.to(dev), blen.to(dev)
        self.inv_freq = inv_freq

    def args(self, q, q_pos, cu, rows=None):
        sl = slice(None) if rows is None else rows
        return dict(q=q, q_pos=q_pos, cu_seqlens_q=cu, k_cache=self.k_cache, v_cache=self.v_cache,
                    block_table=self.block_table[sl], block_pos=self.block_pos[sl],
                    block_delta=self.block_delta[sl], block_len=self.block_len[sl],
                    inv_freq=self.inv_freq, sm_scale=SCALE)


def compact_upcast(a):
    """The same problem on float32 copies of only the pages it uses (for the reference)."""
    bt, blen = a["block_table"], a["block_len"]
    used = torch.unique(bt[blen > 0].long())
    remap = torch.zeros(a["k_cache"].shape[0], dtype=torch.int32, device=bt.device)
    remap[used] = torch.arange(used.numel(), dtype=torch.int32, device=bt.device)
    out = dict(a)
    out["block_table"] = torch.where(blen > 0, remap[bt.long()], 0).to(torch.int32)
    out["k_cache"] = a["k_cache"][used].float()
    out["v_cache"] = a["v_cache"][used].float()
    out["q"] = a["q"].float()
    return out


def sdpa_flash(q, k, v, causal):
    """``aten._scaled_dot_product_flash_attention``: the flash backend, GQA native,
    causal bottom-right aligned. q ``(B, HQ, Lq, D)``, k/v ``(B, HKV, Lk, D)``."""
    if DRY:  # CPU stand-in with the same mask, for --dry-run only
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if causal else None
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float() for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=SCALE)
        return out.to(q.dtype)
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=causal, scale=SCALE)[0]
    except RuntimeError as e:  # no native GQA: expand heads (more bytes for SDPA; reported)
        log(f"sdpa flash op refused GQA shapes ({e!r:.120}); expanding K/V heads")
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=causal, scale=SCALE)[0]


# ----------------------------------------------------------------------------------------
# sections
# ----------------------------------------------------------------------------------------


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
    pg = Paged(1, kv, nq, ps, inv_freq, seed=seed, dev=dev)
    torch.manual_seed(seed + 1)
    qs = torch.randn(1, HQ, nq, D, device=dev, dtype=DTYPE)  # SDPA layout
    q = qs[0].transpose(0, 1).contiguous()  # (nq, HQ, D)
    q_pos = torch.arange(kv - nq, kv, device=dev, dtype=torch.int64)
    cu = torch.tensor([0, nq], device=dev, dtype=torch.int32)
    return pg, qs, q, q_pos, cu


def decode_case(batch, kv, ps, inv_freq, dev):
    """``batch`` sequences of ``kv`` keys (16 of their own), one query each at the last
    position; ``qs`` in SDPA's layout ``(batch, HQ, 1, D)``, ``q`` the kernel's."""
    pg = Paged(batch, kv, 16, ps, inv_freq, seed=batch * 7 + kv, dev=dev)
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


# ----------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------


def _fastest(r, readings):
    """The fastest of the row's readings ``(name, key)`` that it holds, as ``(name, ms)``;
    ``None`` where it holds none."""
    held = [(name, r[key]) for name, key in readings if r.get(key)]
    return min(held, key=lambda x: x[1]) if held else None


def derived(row):
    r = dict(row)
    if "error" in r:
        return r
    if r["kind"] in ("prefill", "decode") and r.get("ms_rope_graph"):
        # the lower of the two interleaved readings of each side (older rows hold one)
        r["ms_rope_graph_min"] = min(r["ms_rope_graph"], r.get("ms_rope_graph2", r["ms_rope_graph"]))
        r["ms_norope_graph_min"] = min(r["ms_norope_graph"], r.get("ms_norope_graph2", r["ms_norope_graph"]))
        r["rope_cost_graph"] = r["ms_rope_graph_min"] / r["ms_norope_graph_min"] - 1
        if r.get("ms_sdpa_graph"):
            r["vs_sdpa_graph"] = r["ms_sdpa_graph"] / r["ms_rope_graph_min"]
    if r["kind"] == "prefill" and "ms_rope" in r:
        r["tflops_rope"] = r["flops"] / r["ms_rope"] / 1e9
        r["tflops_norope"] = r["flops"] / r["ms_norope"] / 1e9
        if r.get("ms_sdpa"):
            r["tflops_sdpa"] = r["flops"] / r["ms_sdpa"] / 1e9
            r["vs_sdpa"] = r["ms_sdpa"] / r["ms_rope"]
        r["rope_cost"] = r["ms_rope"] / r["ms_norope"] - 1
        r["rope_cost_pretable"] = r["ms_rope_pretable"] / r["ms_norope"] - 1
        if r.get("ms_sdpa"):
            r["vs_sdpa_pretable"] = r["ms_sdpa"] / r["ms_rope_pretable"]
        if r.get("ms_triton_pretable"):
            r["triton_rope_cost"] = r["ms_triton_pretable"] / r["ms_triton_norope"] - 1
            r["vs_triton"] = r["ms_triton_pretable"] / r["ms_rope_pretable"]
        if r.get("ms_cudnn"):
            r["tflops_cudnn"] = r["flops"] / r["ms_cudnn"] / 1e9
            r["tflops_cudnn_nomask"] = 4 * HQ * D * r["q"] * r["kv"] / r["ms_cudnn_nomask"] / 1e9
        if r.get("ms_rope_graph"):
            # ours as the engine runs it, against the strongest baseline of the row: the fastest
            # reading of a causal SDPA backend (flash from a graph or do_bench, cuDNN causal), and
            # cuDNN's unmasked kernel by FLOP rate (ours on the causal pairs, it on all pairs)
            r["tflops_rope_graph"] = r["flops"] / r["ms_rope_graph_min"] / 1e9
            best = _fastest(r, (("flash, graph", "ms_sdpa_graph"), ("flash, do_bench", "ms_sdpa"),
                                ("cuDNN causal, graph", "ms_cudnn_graph"), ("cuDNN causal", "ms_cudnn")))
            if best:
                r["best_causal_sdpa"], r["ms_best_causal_sdpa"] = best
                r["vs_best_causal_sdpa"] = r["ms_best_causal_sdpa"] / r["ms_rope_graph_min"]
            # cuDNN unmasked: its faster reading (a graph keeps a small problem's K/V in L2
            # between replays, as ours; do_bench flushes L2)
            nomask = _fastest(r, (("graph", "ms_cudnn_nomask_graph"), ("do_bench", "ms_cudnn_nomask")))
            if nomask:
                r["ms_cudnn_nomask_best"] = nomask[1]
                r["tflops_cudnn_nomask_best"] = 4 * HQ * D * r["q"] * r["kv"] / nomask[1] / 1e9
                r["rate_vs_cudnn_nomask"] = r["tflops_rope_graph"] / r["tflops_cudnn_nomask_best"]
    if r["kind"] == "decode" and "ms_rope" in r:
        r["tbs_rope"] = r["bytes"] / r["ms_rope"] / 1e9
        r["tbs_norope"] = r["bytes"] / r["ms_norope"] / 1e9
        if r.get("ms_sdpa"):
            r["tbs_sdpa"] = r["bytes"] / r["ms_sdpa"] / 1e9
            r["vs_sdpa"] = r["ms_sdpa"] / r["ms_rope"]
        r["rope_cost"] = r["ms_rope"] / r["ms_norope"] - 1
        r["rope_cost_pretable"] = r["ms_rope_pretable"] / r["ms_norope"] - 1
        if r.get("ms_rope_graph"):
            r["tbs_rope_graph"] = r["bytes"] / r["ms_rope_graph_min"] / 1e9
            if r.get("ms_sdpa_graph"):
                r["tbs_sdpa_graph"] = r["bytes"] / r["ms_sdpa_graph"] / 1e9
            # the strongest SDPA backend of the row: flash (FA2) or cuDNN, both from CUDA graphs
            if r.get("ms_cudnn_graph"):
                r["ms_cudnn_graph_min"] = min(r["ms_cudnn_graph"], r.get("ms_cudnn_graph2", r["ms_cudnn_graph"]))
            best = _fastest(r, (("flash", "ms_sdpa_graph"), ("cuDNN", "ms_cudnn_graph_min")))
            if best:
                r["best_sdpa"], r["ms_best_sdpa_graph"] = best
                r["tbs_best_sdpa_graph"] = r["bytes"] / r["ms_best_sdpa_graph"] / 1e9
                r["vs_best_sdpa_graph"] = r["ms_best_sdpa_graph"] / r["ms_rope_graph_min"]
    if r["kind"] == "rerotate" and "ms" in r:
        r["tbs"] = r["bytes"] / r["ms"] / 1e9
        r["tbs_torch_copy"] = r["bytes"] / r["ms_torch_copy"] / 1e9
        r["tbs_ref"] = r["bytes"] / r["ms_ref"] / 1e9
        r["vs_copy"] = r["ms_torch_copy"] / r["ms"]
    return r


def fmt_row(row):
    """One log line for a row."""
    r = derived(row)
    nan = float("nan")
    if "error" in r:
        return f"{r['kind']} {r.get('q', r.get('batch'))}/{r.get('kv')} ERROR {r['error']}"
    if r["kind"] == "prefill":
        line = (f"prefill q={r['q']:5d} kv={r['kv']:6d} | ours {r['ms_rope']:.3f} ms {r['tflops_rope']:.0f} TF/s | "
                f"rope-off {r['ms_norope']:.3f} | sdpa {r.get('ms_sdpa', nan):.3f} ms "
                f"{r.get('tflops_sdpa', nan):.0f} TF/s | x{r.get('vs_sdpa', nan):.2f} | "
                f"rope +{100 * r['rope_cost']:.1f}% (pretable +{100 * r['rope_cost_pretable']:.1f}%) | "
                f"err ref {r.get('err_ref', nan):.1e} sdpa {r.get('err_sdpa', nan):.1e} nan={r['nan']} | "
                f"{r.get('kernel')}")
        if r.get("ms_triton_pretable"):
            line += (f" | triton {r['ms_triton_pretable']:.3f} ms (x{r['vs_triton']:.2f} of it), its rope "
                     f"+{100 * r['triton_rope_cost']:.1f}%")
        if r.get("ms_rope_graph"):
            line += (f" | graph: ours {r['ms_rope_graph']:.4f}/{r['ms_rope_graph2']:.4f} ms rope-off "
                     f"{r['ms_norope_graph']:.4f}/{r['ms_norope_graph2']:.4f} sdpa {r.get('ms_sdpa_graph', nan):.4f} "
                     f"x{r.get('vs_sdpa_graph', nan):.2f} rope {100 * r['rope_cost_graph']:+.1f}%")
        return line
    if r["kind"] == "decode":
        line = (f"decode  b={r['batch']:4d} kv={r['kv']:6d} | ours {r['ms_rope']:.3f} ms {r['tbs_rope']:.2f} TB/s | "
                f"rope-off {r['ms_norope']:.3f} | sdpa {r.get('ms_sdpa', nan):.3f} ms "
                f"{r.get('tbs_sdpa', nan):.2f} TB/s | x{r.get('vs_sdpa', nan):.2f} | "
                f"rope +{100 * r['rope_cost']:.1f}% (pretable +{100 * r['rope_cost_pretable']:.1f}%) | "
                f"err ref {r['err_ref']:.1e} sdpa {r.get('err_sdpa', nan):.1e} nan={r['nan']}")
        if r.get("ms_rope_graph"):
            line += (f" | graph: ours {r['ms_rope_graph_min']:.3f} ms {r['tbs_rope_graph']:.2f} TB/s "
                     f"sdpa {r.get('ms_sdpa_graph', nan):.3f} x{r.get('vs_sdpa_graph', nan):.2f} "
                     f"cudnn {r.get('ms_cudnn_graph_min', nan):.3f} best {r.get('best_sdpa')} "
                     f"x{r.get('vs_best_sdpa_graph', nan):.3f} rope +{100 * r['rope_cost_graph']:.1f}%")
        return line
    return (f"rerotate L={r['layers']} pages={r['pages']} | {r['ms']:.3f} ms {r['tbs']:.2f} TB/s | "
            f"torch copy {r['tbs_torch_copy']:.2f} TB/s | x{r['vs_copy']:.2f} of copy | "
            f"naive torch {r['ms_ref']:.3f} ms | err {r['err_k']:.1e} v_equal={r['v_equal']}")


def md_table(intro, header, body, align=None):
    """A paragraph (``None``: none), then a markdown table of ``body`` rows under ``header``
    (a row may be shorter: an error row), then a blank line. ``align``: a separator per
    column (``"---:"`` right-aligns), ``"---"`` for each by default."""
    align = align or ["---"] * len(header)
    lines = [intro, ""] if intro is not None else []
    lines += ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in body] + [""]


def markdown(meta, rows):
    L = [f"Device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; {meta['date']}; "
         f"page size {meta['page_size']}; device-to-device copy {meta['copy_tbs']:.2f} TB/s.", ""]
    pre = [derived(r) for r in rows if r["kind"] == "prefill"]
    dec = [derived(r) for r in rows if r["kind"] == "decode"]
    cp = [derived(r) for r in rows if r["kind"] == "rerotate"]
    if pre:
        L += md_table(
            "`ours` builds the step's cos/sin and runs tables in the call (launch-bound at small shapes); the engine "
            "builds them once per step for all layers, so `table prebuilt` is the per-layer figure.",
            ["prefill q", "kv", "kernel", "ours ms", "ours TFLOP/s", "SDPA ms", "SDPA TFLOP/s", "ours/SDPA",
             "ours ms, table prebuilt", "ours/SDPA, table prebuilt", "rope off ms", "RoPE cost",
             "RoPE cost, table prebuilt", "rel err vs ref"],
            [[r["q"], r["kv"], f"error: {r['error'][:80]}"] if "error" in r else
             [r["q"], r["kv"], r.get("kernel", "triton"), f"{r['ms_rope']:.3f}", f"{r['tflops_rope']:.0f}",
              f"{r['ms_sdpa']:.3f}", f"{r['tflops_sdpa']:.0f}", f"{100 * r['vs_sdpa']:.0f}%",
              f"{r['ms_rope_pretable']:.3f}", f"{100 * r['vs_sdpa_pretable']:.0f}%", f"{r['ms_norope']:.3f}",
              f"{100 * r['rope_cost']:+.1f}%", f"{100 * r['rope_cost_pretable']:+.1f}%", f"{r['err_ref']:.1e}"]
             for r in pre])
        tri = [r for r in pre if r.get("ms_triton_pretable")]
        if tri:
            L += md_table(
                "Where the Gluon prefill served the call (Hopper, `padding_finite=True` as the engine passes), the "
                "Triton prefill (`prefill_kernel=\"triton\"`) on the same shapes, table prebuilt:",
                ["prefill q", "kv", "Triton ms", "Triton rope off ms", "its RoPE cost", "Triton/Gluon time"],
                [[r["q"], r["kv"], f"{r['ms_triton_pretable']:.3f}", f"{r['ms_triton_norope']:.3f}",
                  f"{100 * r['triton_rope_cost']:+.1f}%", f"{r['vs_triton']:.2f}x"] for r in tri])
        gr = [r for r in pre if r.get("ms_rope_graph")]
        if gr:
            L += md_table(
                "Prefill replayed from one CUDA graph (tables prebuilt; the GPU time without the launcher's gaps; "
                "each side timed twice, interleaved, and the lower reading kept):",
                ["prefill q", "kv", "kernel", "ours ms", "SDPA ms", "ours/SDPA", "rope off ms", "RoPE cost"],
                [[r["q"], r["kv"], r.get("kernel", "triton"), f"{r['ms_rope_graph_min']:.4f}",
                  f"{r.get('ms_sdpa_graph', float('nan')):.4f}", f"{100 * r.get('vs_sdpa_graph', float('nan')):.0f}%",
                  f"{r['ms_norope_graph_min']:.4f}", f"{100 * r['rope_cost_graph']:+.1f}%"] for r in gr])
        cu = [r for r in pre if r.get("ms_cudnn")]
        if cu:
            L += md_table(
                "SDPA's cuDNN backend on the same shapes: the causal problem (TFLOP/s on the causal count, as above), "
                "and the same shape without the mask (TFLOP/s on all q x kv pairs: more work than the causal "
                "problem needs):",
                ["prefill q", "kv", "cuDNN causal ms", "TFLOP/s", "rel err vs flash", "cuDNN unmasked ms",
                 "TFLOP/s (all pairs)"],
                [[r["q"], r["kv"], f"{r['ms_cudnn']:.3f}", f"{r['tflops_cudnn']:.0f}", f"{r['err_cudnn']:.1e}",
                  f"{r['ms_cudnn_nomask']:.3f}", f"{r['tflops_cudnn_nomask']:.0f}"]
                 for r in cu])
        sb = [r for r in pre if r.get("best_causal_sdpa")]
        if sb:
            nan = float("nan")
            L += md_table(
                "Against the strongest baseline (ours from CUDA graphs, TFLOP/s on the causal pair count; the "
                "fastest causal SDPA reading of the row, named; cuDNN's unmasked kernel, the FA3-class reference, "
                "by FLOP rate on all pairs, its faster reading of a CUDA graph and do_bench):",
                ["new tokens", "keys", "our kernel", "ours ms", "ours TFLOP/s", "fastest causal SDPA", "its ms",
                 "its time / ours", "cuDNN unmasked ms", "its TFLOP/s", "ours / cuDNN unmasked rate", "RoPE cost"],
                [[r["q"], r["kv"], r.get("kernel", "triton").capitalize(), f"{r['ms_rope_graph_min']:.4f}",
                  f"{r['tflops_rope_graph']:.0f}", r["best_causal_sdpa"], f"{r['ms_best_causal_sdpa']:.4f}",
                  f"{100 * r['vs_best_causal_sdpa']:.0f}%", f"{r.get('ms_cudnn_nomask_best', nan):.4f}",
                  f"{r.get('tflops_cudnn_nomask_best', nan):.0f}", f"{100 * r.get('rate_vs_cudnn_nomask', nan):.0f}%",
                  f"{100 * r['rope_cost_graph']:+.1f}%"] for r in sb],
                ["---:", "---:", "---"] + ["---:"] * 2 + ["---"] + ["---:"] * 6)
    if dec:
        L += md_table(
            None,
            ["decode batch", "kv", "ours ms", "ours TB/s", "SDPA ms", "SDPA TB/s", "ours/SDPA", "rope off ms",
             "RoPE cost", "RoPE cost, table prebuilt", "rel err vs ref"],
            [[r["batch"], r["kv"], f"error: {r['error'][:80]}"] if "error" in r else
             [r["batch"], r["kv"], f"{r['ms_rope']:.3f}", f"{r['tbs_rope']:.2f}", f"{r['ms_sdpa']:.3f}",
              f"{r['tbs_sdpa']:.2f}", f"{100 * r['vs_sdpa']:.0f}%", f"{r['ms_norope']:.3f}",
              f"{100 * r['rope_cost']:+.1f}%", f"{100 * r['rope_cost_pretable']:+.1f}%", f"{r['err_ref']:.1e}"]
             for r in dec])
        gr = [r for r in dec if r.get("ms_rope_graph")]
        if gr:
            nan = float("nan")
            L += md_table(
                "Decode replayed from one CUDA graph (as the engine runs it: no launch gaps, L2 not flushed; cos/sin "
                "table prebuilt; ours and cuDNN each timed twice, interleaved, the lower reading kept). SDPA reads "
                "dense, contiguous, already rotated K/V; ours reads pages. `ours/strongest`: the strongest "
                "backend's time over ours (bandwidth ratio, paged against dense):",
                ["decode batch", "kv", "ours ms", "ours TB/s", "strongest SDPA", "its ms", "its TB/s",
                 "ours/strongest", "flash ms", "cuDNN ms", "rope off ms", "RoPE cost"],
                [[r["batch"], r["kv"], f"{r['ms_rope_graph_min']:.3f}", f"{r['tbs_rope_graph']:.2f}",
                  r.get("best_sdpa", "?"), f"{r.get('ms_best_sdpa_graph', nan):.3f}",
                  f"{r.get('tbs_best_sdpa_graph', nan):.2f}", f"{100 * r.get('vs_best_sdpa_graph', nan):.0f}%",
                  f"{r.get('ms_sdpa_graph', nan):.3f}", f"{r.get('ms_cudnn_graph_min', nan):.3f}",
                  f"{r['ms_norope_graph_min']:.3f}", f"{100 * r['rope_cost_graph']:+.1f}%"] for r in gr])
    pr = [r for r in rows if r["kind"] == "prefill_runs" and "error" not in r]
    if pr:
        kerns = [k[3:-5] for k in pr[0] if k.startswith("ms_") and k.endswith("_real")]
        L += md_table(
            "Where the prefill's RoPE cost goes (`--prefill-runs`, from CUDA graphs, lowest of three readings): "
            "RoPE on with the real deltas, with every delta 0 (one run), and RoPE off; the RoPE cost split into "
            "the one-run part and the part of the run switches:",
            ["q", "kv", "runs", "kernel", "real ms", "one run ms", "off ms", "RoPE cost", "one run over off",
             "runs over one run", "per run"],
            [[r["q"], r["kv"], r["runs"], k, f"{r[f'ms_{k}_real']:.4f}", f"{r[f'ms_{k}_one_run']:.4f}",
              f"{r[f'ms_{k}_off']:.4f}", f"{100 * (r[f'ms_{k}_real'] / r[f'ms_{k}_off'] - 1):+.1f}%",
              f"{100 * (r[f'ms_{k}_one_run'] / r[f'ms_{k}_off'] - 1):+.1f}%",
              f"{100 * (r[f'ms_{k}_real'] - r[f'ms_{k}_one_run']) / r[f'ms_{k}_off']:+.1f}%",
              f"{1e3 * (r[f'ms_{k}_real'] - r[f'ms_{k}_one_run']) / max(r['runs'] - 1, 1):.2f} us"]
             for r in pr for k in kerns])
    if cp:
        L += md_table(
            None,
            ["re-rotate copy", "ms", "TB/s", "torch copy, same bytes", "of copy bandwidth", "naive torch ms"],
            [[f"{r['layers']} layers x {r['pages']} pages of {r['page_size']} (rows {r['block_rows']}, warps "
              f"{r['num_warps']})", f"{r['ms']:.3f}", f"{r['tbs']:.2f}", f"{r['tbs_torch_copy']:.2f} TB/s",
              f"{100 * r['vs_copy']:.0f}%", f"{r['ms_ref']:.3f}"] for r in cp if "error" not in r])
    return "\n".join(L)


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
