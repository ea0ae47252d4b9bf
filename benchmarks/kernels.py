"""Kernel benchmark: deferred-RoPE paged attention (Triton) against torch SDPA (flash).

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128), bfloat16, one
layer, on one GPU. Prints a table and writes ``kernels.json`` and ``kernels.md`` to --out.

    python3 benchmarks/kernels.py --out OUT_DIR [--sweep] [--page-size 16]

What is measured
----------------
* Prefill: ``q`` new tokens of one sequence over ``kv`` keys in total: ``kv - q`` cached
  tokens in chunks of 448..576 tokens, each at a random nonzero delta, then the ``q``
  tokens' own pages (delta 0); page ids shuffled over the pool. Query ``i`` (at position
  ``kv - q + i``) sees ``kv - q + i + 1`` keys, so the causal-aware count is
  ``FLOPs = 4 * heads * head_dim * (q * (kv - q) + q * (q + 1) / 2)``.
  SDPA runs the same logical problem on contiguous, already-rotated K/V through
  ``aten._scaled_dot_product_flash_attention`` with ``is_causal=True`` (which means
  bottom-right aligned for that op, the same mask), GQA native. For context the table
  also gives SDPA's cuDNN backend: the same causal problem (``causal_lower_right`` mask,
  GQA native), and the same shape without the mask, whose rate is counted on all
  ``q * kv`` pairs (``FLOPs = 4 * heads * head_dim * q * kv``). That unmasked cuDNN kernel is
  SDPA's fastest on an H200 (about 600 TFLOP/s), and is where DESIGN.md's reference figure
  of 562 TFLOP/s at q=512 over 8704 comes from; with the causal mask cuDNN ran slower
  than the flash backend (BENCHMARKS.md, "Kernels (issue 3)").
* Decode: ``batch`` sequences of ``kv`` keys each (chunked the same way), one query each.
  ``TB/s = bytes / time`` with ``bytes = K and V read once (batch * kv * 8 * 128 * 2 * 2)
  + q + out``; the same count for both kernels.
* Deferred RoPE cost: the same kernel with ``use_rope=False`` (no rotation; all else
  equal). "rope" times include building the cos/sin table of the step (``rope_table``);
  an engine builds it once per step for all layers.
* Re-rotate copy (the Block-Attention baseline): 32 layers, pages of 16 tokens, bytes read
  + written, against ``torch`` copying the same number of bytes device to device.

Times are ``triton.testing.do_bench`` medians (it flushes L2 before every run). Before
timing, every configuration is checked against ``reference.paged_attention_ref`` on
float32-upcast inputs (a slice of the queries; pages compacted), and against SDPA.
"""
from __future__ import annotations

import argparse
import datetime
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

import torch

ROOT = Path(__file__).resolve().parents[1]
try:  # the installed package, else the source tree
    from lazyllm.kernels import KernelOptions, triton_kernels
    from lazyllm.kernels import reference as ref
except ImportError:
    sys.path.insert(0, str(ROOT))
    from kernels import KernelOptions, triton_kernels  # type: ignore
    from kernels import reference as ref  # type: ignore

ta = triton_kernels(interpret=DRY)

import triton
import triton.testing

# the prefill kernel's QROT values, as this script names loops, to KernelOptions.loop
_LOOP_NAMES = {0: "per_tile", 1: "per_run", 2: "flat_runs", 3: "halves"}
_OPTION_FIELDS = set(KernelOptions.__dataclass_fields__)


def attention(**kw):
    """``paged_attention_triton`` with this script's launch choices (``config``,
    ``num_splits``, ``qrot`` as the kernel's ``QROT`` 0-3 or a bool, ``prefill_kernel``, ...)
    passed as ``KernelOptions``."""
    if "qrot" in kw:
        qrot = kw.pop("qrot")
        kw["loop"] = None if qrot is None else _LOOP_NAMES[int(qrot)]
    opts = {k: kw.pop(k) for k in list(kw) if k in _OPTION_FIELDS}
    return ta.paged_attention_triton(**kw, options=KernelOptions(**opts))

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
SCALE = D ** -0.5
PREFILL = [(64, 4096), (64, 8192), (64, 32768), (512, 4096), (512, 8192), (512, 32768),
           (2048, 4096), (2048, 8192), (2048, 32768)]
DECODE = [(1, 4096), (1, 16384), (1, 32768), (32, 4096), (32, 16384), (32, 32768),
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

    def __init__(self, batch, kv, n_own, page_size, inv_freq, seed=0, dev="cuda", shared=False):
        # shared: every row reads the same pages (every request over the same chunks, as in
        # RAG where one chunk is retrieved by many requests); else each row its own
        g = random.Random(seed)
        torch.manual_seed(seed)
        self.batch, self.kv, self.page_size = batch, kv, page_size
        nb = 1 if shared else batch
        self.k_sdpa = torch.randn(nb, HKV, kv, D, device=dev, dtype=DTYPE)
        self.v_sdpa = torch.randn(nb, HKV, kv, D, device=dev, dtype=DTYPE)
        rows = []
        for _ in range(nb):
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
        bt = torch.zeros(nb, max_blocks, dtype=torch.int32)
        bpos = torch.zeros_like(bt)
        bdelta = torch.zeros_like(bt)
        blen = torch.zeros_like(bt)
        slot_of_token = torch.empty(nb, kv, dtype=torch.int64)
        delta_of_token = torch.empty(nb, kv, dtype=torch.int64)
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
        for b in range(nb):
            k_tok = self.k_sdpa[b].transpose(0, 1)  # (kv, HKV, D)
            k_tok = ref.rotate_by_delta(k_tok, -delta_of_token[b].to(dev), inv_freq)
            idx = slot_of_token[b].to(dev)
            kf.index_copy_(0, idx, k_tok)
            vf.index_copy_(0, idx, self.v_sdpa[b].transpose(0, 1))
        if shared:
            bt, bpos, bdelta, blen = (t.expand(batch, -1).contiguous() for t in (bt, bpos, bdelta, blen))
            self.k_sdpa = self.k_sdpa.expand(batch, -1, -1, -1)
            self.v_sdpa = self.v_sdpa.expand(batch, -1, -1, -1)
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
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=SCALE).to(q.dtype)
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


def copy_bandwidth(dev):
    n = 1 << 30 if not DRY else 1 << 16  # 2 GiB of bf16
    src = torch.randn(n, device=dev, dtype=DTYPE)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e9, ms  # TB/s (read + write)


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
    output) and the same shape unmasked; none in the dry run."""
    row = {}
    if DRY:
        return row
    try:
        row["err_cudnn"] = relerr(sdpa_cudnn(qs, k, v, True), s_out)
        row["ms_cudnn"] = bench(lambda: sdpa_cudnn(qs, k, v, True))
        row["ms_cudnn_nomask"] = bench(lambda: sdpa_cudnn(qs, k, v, False))
    except Exception as e:  # no cuDNN attention in this build: the row keeps the rest
        row["cudnn_error"] = repr(e)[:200]
    return row


def prefill_case(nq, kv, ps, inv_freq, dev, seed=0):
    pg = Paged(1, kv, nq, ps, inv_freq, seed=seed, dev=dev)
    torch.manual_seed(seed + 1)
    qs = torch.randn(1, HQ, nq, D, device=dev, dtype=DTYPE)  # SDPA layout
    q = qs[0].transpose(0, 1).contiguous()  # (nq, HQ, D)
    q_pos = torch.arange(kv - nq, kv, device=dev, dtype=torch.int64)
    cu = torch.tensor([0, nq], device=dev, dtype=torch.int32)
    return pg, qs, q, q_pos, cu


def decode_case(batch, kv, ps, inv_freq, dev, shared=False):
    """``batch`` sequences of ``kv`` keys (16 of their own), one query each at the last
    position; ``qs`` in SDPA's layout ``(batch, HQ, 1, D)``, ``q`` the kernel's."""
    pg = Paged(batch, kv, 16, ps, inv_freq, seed=batch * 7 + kv, dev=dev, shared=shared)
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
        from lazyllm.kernels.triton import gluon_prefill as gp
    except Exception:  # noqa: BLE001  (no Gluon in this triton)
        return
    real = gp.paged_prefill_gluon

    def counted(*a, **k):
        _GLUON_CALLS[0] += 1
        return real(*a, **k)

    gp.paged_prefill_gluon = counted


def run_prefill(nq, kv, ps, inv_freq, dev, configs=None, splits=(None,), sdpa=True, extra=None, graphs=False):
    """Times the launcher (default config unless ``configs``), rope on/off, and SDPA.

    With ``graphs`` the same calls (tables prebuilt) are also replayed from one CUDA graph:
    the GPU time without the Python launcher's gaps, which is what a short prefill (a few
    dozen microseconds) is otherwise dominated by. The launcher is called as the engine calls it (``padding_finite=True``: the pool's
    pages are finite), so on Hopper the default prefill is the Gluon kernel; the Triton
    prefill (``prefill_kernel="triton"``) is then timed too."""
    pg, qs, q, q_pos, cu = prefill_case(nq, kv, ps, inv_freq, dev)
    a = pg.args(q, q_pos, cu)
    out = torch.empty_like(q)
    pairs = nq * (kv - nq) + nq * (nq + 1) / 2
    flops = 4 * HQ * D * pairs
    res = []
    s_out = None
    s_ms = None
    cud = {}
    if sdpa:
        s_out = sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True)
        s_ms = bench(lambda: sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True))
        cud = run_cudnn(qs, pg.k_sdpa, pg.v_sdpa, s_out)
    for cfg in configs or [None]:
        for sp in splits:
            row = dict(kind="prefill", q=nq, kv=kv, page_size=ps, config=cfg, splits=sp, flops=flops, extra=extra, **cud)
            kw = dict(padding_finite=True, **(extra or {}))
            try:
                out.fill_(float("nan"))
                n0 = _GLUON_CALLS[0]
                attention(**a, out=out, max_seqlen_q=nq, config=cfg, num_splits=sp, **kw)
                sync()
                row["kernel"] = "gluon" if _GLUON_CALLS[0] > n0 else "triton"
                row["nan"] = bool(torch.isnan(out).any())
                row["err_ref"], row["err_sdpa"] = check_prefill(pg, qs, q, q_pos, cu, out, s_out)
                row["ms_rope"] = bench(lambda: attention(
                    **a, out=out, max_seqlen_q=nq, config=cfg, num_splits=sp, **kw))
                row["ms_norope"] = bench(lambda: attention(
                    **a, out=out, max_seqlen_q=nq, config=cfg, num_splits=sp, use_rope=False, **kw))
                rt = ta.rope_table(pg.block_delta, inv_freq)
                row["ms_rope_pretable"] = bench(lambda: attention(
                    **a, out=out, max_seqlen_q=nq, config=cfg, num_splits=sp, rope=rt, **kw))
                if row["kernel"] == "gluon":
                    tk = dict(kw, prefill_kernel="triton")
                    row["ms_triton_pretable"] = bench(lambda: attention(
                        **a, out=out, max_seqlen_q=nq, config=cfg, num_splits=sp, rope=rt, **tk))
                    row["ms_triton_norope"] = bench(lambda: attention(
                        **a, out=out, max_seqlen_q=nq, config=cfg, num_splits=sp, use_rope=False, **tk))
                if graphs and not DRY:
                    row["ms_rope_graph"] = bench_graph(lambda: attention(
                        **a, out=out, max_seqlen_q=nq, config=cfg, num_splits=sp, rope=rt, **kw))
                    row["ms_norope_graph"] = bench_graph(lambda: attention(
                        **a, out=out, max_seqlen_q=nq, config=cfg, num_splits=sp, use_rope=False, **kw))
                    # again, interleaved: the two readings of each side bound the noise
                    row["ms_rope_graph2"] = bench_graph(lambda: attention(
                        **a, out=out, max_seqlen_q=nq, config=cfg, num_splits=sp, rope=rt, **kw))
                    row["ms_norope_graph2"] = bench_graph(lambda: attention(
                        **a, out=out, max_seqlen_q=nq, config=cfg, num_splits=sp, use_rope=False, **kw))
                    if sdpa:
                        row["ms_sdpa_graph"] = bench_graph(lambda: sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True))
            except Exception as e:  # keep the rest of the run
                row["error"] = repr(e)[:300]
                traceback.print_exc()
            if s_ms is not None:
                row["ms_sdpa"] = s_ms
            res.append(row)
            log(fmt_row(row))
    del pg
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


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
        kw = dict(out=out, max_seqlen_q=nq, padding_finite=True, prefill_kernel=kern)
        calls[(kern, "real")] = (lambda kw=kw: attention(**a, rope=rt, **kw))
        calls[(kern, "one_run")] = (lambda kw=kw: attention(**a0, rope=rt0, **kw))
        calls[(kern, "off")] = (lambda kw=kw: attention(**a, use_rope=False, **kw))
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
        log(f"prefill runs q={nq:5d} kv={kv:6d} {kern:6s} runs {runs:3d} | real {real:.4f} one run {one:.4f} off {off:.4f} ms"
            f" | RoPE {100 * (real / off - 1):+.1f}% = one run {100 * (one / off - 1):+.1f}% + runs "
            f"{100 * (real - one) / off:+.1f}% ({1e3 * (real - one) / max(runs - 1, 1):.2f} us a run)")
    del pg
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return [row]


def run_prefill_diag(nq, kv, inv_freq, dev, qrot, cfg):
    """Where the deferred-RoPE cost of a query-rotating prefill goes (pages of 64, tables
    prebuilt): the real deltas, the same kernel with every delta 0 (one run: the per-tile
    cost of carrying the rotated query), and RoPE off."""
    pg, qs, q, q_pos, cu = prefill_case(nq, kv, 64, inv_freq, dev)
    a = pg.args(q, q_pos, cu)
    out = torch.empty_like(q)
    flops = 4 * HQ * D * (nq * (kv - nq) + nq * (nq + 1) / 2)
    kw = dict(out=out, max_seqlen_q=nq, config=cfg, qrot=qrot)
    row = dict(kind="prefill_diag", q=nq, kv=kv, qrot=qrot, config=cfg, flops=flops)
    try:
        attention(**a, **kw)
        sync()
        s_out = sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True)
        row["err_ref"], row["err_sdpa"] = check_prefill(pg, qs, q, q_pos, cu, out, s_out)
        rt = ta.rope_table(pg.block_delta, inv_freq)
        rt0 = ta.rope_table(torch.zeros_like(pg.block_delta), inv_freq)
        row["ms_rope"] = bench(lambda: attention(**a, rope=rt, **kw))
        row["ms_rope_one_run"] = bench(lambda: attention(**a, rope=rt0, **kw))
        row["ms_norope"] = bench(lambda: attention(**a, use_rope=False, **kw))
        row["ms_sdpa"] = bench(lambda: sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True))
        row["runs"] = int((pg.block_delta[:, 1:] != pg.block_delta[:, :-1]).sum()) + 1
        log(f"diag q={nq} kv={kv} qrot={qrot} cfg={cfg} | rope {row['ms_rope']:.4f} one-run {row['ms_rope_one_run']:.4f} "
            f"off {row['ms_norope']:.4f} sdpa {row['ms_sdpa']:.4f} ms | rope +{100 * (row['ms_rope'] / row['ms_norope'] - 1):.1f}% "
            f"(one run +{100 * (row['ms_rope_one_run'] / row['ms_norope'] - 1):.1f}%) | ours/SDPA "
            f"{row['ms_sdpa'] / row['ms_rope']:.2f} | runs {row['runs']} | err ref {row['err_ref']:.1e}")
    except Exception as e:  # keep the rest of the run
        row["error"] = repr(e)[:300]
        traceback.print_exc()
    return [row]


def run_decode(batch, kv, ps, inv_freq, dev, configs=None, splits=(None,), sdpa=True, n_check=2, extra=None,
               graphs=False):
    pg, qs, q, q_pos, cu = decode_case(batch, kv, ps, inv_freq, dev)
    a = pg.args(q, q_pos, cu)
    out = torch.empty_like(q)
    nbytes = batch * kv * HKV * D * 2 * 2 + 2 * q.numel() * 2
    res = []
    s_out = s_ms = None
    if sdpa:
        s_out = sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, False)[:, :, 0]
        s_ms = bench(lambda: sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, False))
    c = min(n_check, batch)
    r = decode_ref(pg, q, q_pos, cu, c)
    for cfg in configs or [None]:
        for sp in splits:
            row = dict(kind="decode", batch=batch, kv=kv, page_size=ps, config=cfg, splits=sp, bytes=nbytes, extra=extra)
            kw = dict(extra or {})
            try:
                out.fill_(float("nan"))
                attention(**a, out=out, max_seqlen_q=1, config=cfg, num_splits=sp, **kw)
                sync()
                row["nan"] = bool(torch.isnan(out).any())
                row["err_ref"] = relerr(out[:c], r)
                if s_out is not None:
                    row["err_sdpa"] = relerr(out, s_out)
                row["ms_rope"] = bench(lambda: attention(
                    **a, out=out, max_seqlen_q=1, config=cfg, num_splits=sp, **kw))
                row["ms_norope"] = bench(lambda: attention(
                    **a, out=out, max_seqlen_q=1, config=cfg, num_splits=sp, use_rope=False, **kw))
                rt = ta.rope_table(pg.block_delta, inv_freq)
                row["ms_rope_pretable"] = bench(lambda: attention(
                    **a, out=out, max_seqlen_q=1, config=cfg, num_splits=sp, rope=rt, **kw))
                if graphs and not DRY:  # as the engine runs decode: one CUDA graph, no launch gaps
                    # each side twice, interleaved, the lower reading kept (as for prefill)
                    for rnd in ("", "2"):
                        row["ms_rope_graph" + rnd] = bench_graph(lambda: attention(
                            **a, out=out, max_seqlen_q=1, config=cfg, num_splits=sp, rope=rt, **kw))
                        row["ms_norope_graph" + rnd] = bench_graph(lambda: attention(
                            **a, out=out, max_seqlen_q=1, config=cfg, num_splits=sp, use_rope=False, **kw))
                    if s_ms is not None:
                        row["ms_sdpa_graph"] = bench_graph(lambda: sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, False))
            except Exception as e:
                row["error"] = repr(e)[:300]
                traceback.print_exc()
            if s_ms is not None:
                row["ms_sdpa"] = s_ms
            res.append(row)
            log(fmt_row(row))
    del pg
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return res


DECODE_LOOPS = (("flat", None, None), ("halves64", 3, (0, 64, 4, 3)), ("halves32", 3, (0, 32, 4, 3)))


def run_decode_choice(batch, kv, ps, inv_freq, dev, shared, loops=DECODE_LOOPS):
    """Decode from CUDA graphs, as the engine calls it (cos/sin and runs tables prebuilt,
    ``padding_finite=True``), under each loop of ``loops`` (name, qrot, config), RoPE on and
    off: all timed once, then all again, and the lower reading of each kept. ``shared``:
    every row over the same pages (L2 serves the repeats) instead of its own."""
    pg, _, q, q_pos, cu = decode_case(batch, kv, ps, inv_freq, dev, shared=shared)
    a = pg.args(q, q_pos, cu)
    rt = ta.rope_table(pg.block_delta, inv_freq)
    out = torch.empty_like(q)
    c = min(2, batch)
    r = decode_ref(pg, q, q_pos, cu, c)
    row = dict(kind="decode_choice", batch=batch, kv=kv, page_size=ps, shared=shared,
               bytes=batch * kv * HKV * D * 2 * 2 + 2 * q.numel() * 2)
    calls = {}
    try:
        for name, qrot, cfg in loops:
            for rope in (True, False):
                kw = dict(a, out=out, max_seqlen_q=1, config=cfg, qrot=qrot, padding_finite=True)
                kw.update(rope=rt) if rope else kw.update(use_rope=False)
                calls[(name, rope)] = (lambda kw=kw: attention(**kw))
            out.fill_(float("nan"))
            calls[(name, True)]()
            sync()
            row[f"err_{name}"] = relerr(out[:c], r)
        for (name, rope), t in bench_interleaved(calls, 2).items():
            row[f"ms_{name}_{'rope' if rope else 'off'}"] = t
    except Exception as e:  # noqa: BLE001
        row["error"] = repr(e)[:300]
        traceback.print_exc()
    if "error" not in row:
        best_off = min(row[f"ms_{n}_off"] for n, _, _ in loops)
        log(f"decode b={batch:4d} kv={kv:6d} {'shared' if shared else 'own   '} | " + " | ".join(
            f"{n} {row[f'ms_{n}_rope']:.4f} ms (off {row[f'ms_{n}_off']:.4f}, rope {100 * (row[f'ms_{n}_rope'] / row[f'ms_{n}_off'] - 1):+.1f}%, "
            f"vs best off {100 * (row[f'ms_{n}_rope'] / best_off - 1):+.1f}%, err {row[f'err_{n}']:.1e})" for n, _, _ in loops))
    else:
        log(f"decode b={batch} kv={kv} shared={shared} ERROR {row['error']}")
    del pg
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [row]


def run_copy(inv_freq, dev, copy_tbs, n_layers=32, ps=16, n=256, variants=((None, None),)):
    """Re-rotate ``n`` pages (4096 tokens) in each of ``n_layers`` layers."""
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
    res = []
    for rows, warps in variants:
        row = dict(kind="rerotate", layers=n_layers, pages=n, page_size=ps, bytes=nbytes, block_rows=rows,
                   num_warps=warps, ms_torch_copy=ms_copy, ms_ref=ms_ref, copy_ceiling_tbs=copy_tbs)
        try:
            k2, v2 = k.clone(), v.clone()
            ta.rerotate_copy_triton(k2, v2, src, dst, delta, inv_freq, block_rows=rows, num_warps=warps)
            row["err_k"] = relerr(k2[:, dst.long()], kr[:, dst.long()])
            row["v_equal"] = bool(torch.equal(v2[:, dst.long()], vr[:, dst.long()]))
            row["ms"] = bench(lambda: ta.rerotate_copy_triton(k2, v2, src, dst, delta, inv_freq,
                                                              block_rows=rows, num_warps=warps))
        except Exception as e:
            row["error"] = repr(e)[:300]
            traceback.print_exc()
        res.append(row)
        log(fmt_row(row))
    return res


# ----------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------


def derived(row):
    r = dict(row)
    if "error" in r:
        return r
    if r["kind"] in ("prefill", "decode") and r.get("ms_rope_graph"):
        # the lower of the two interleaved readings of each side (decode rows from before
        # session 11 hold one)
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
            r["vs_cudnn_nomask"] = r["ms_cudnn_nomask"] / r["ms_rope"]
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
    if r["kind"] == "rerotate" and "ms" in r:
        r["tbs"] = r["bytes"] / r["ms"] / 1e9
        r["tbs_torch_copy"] = r["bytes"] / r["ms_torch_copy"] / 1e9
        r["tbs_ref"] = r["bytes"] / r["ms_ref"] / 1e9
        r["vs_copy"] = r["ms_torch_copy"] / r["ms"]
    return r


def fmt_row(row):
    r = derived(row)
    if "error" in r:
        return f"{r['kind']} {r.get('q', r.get('batch'))}/{r.get('kv')} cfg={r.get('config')} ERROR {r['error']}"
    if r["kind"] == "prefill":
        return (f"prefill q={r['q']:5d} kv={r['kv']:6d} cfg={r['config']} sp={r['splits']} "
                f"{r.get('extra') or ''} | ours {r['ms_rope']:.3f} ms "
                f"{r['tflops_rope']:.0f} TF/s | rope-off {r['ms_norope']:.3f} | sdpa {r.get('ms_sdpa', float('nan')):.3f} ms "
                f"{r.get('tflops_sdpa', float('nan')):.0f} TF/s | x{r.get('vs_sdpa', float('nan')):.2f} | rope +{100 * r['rope_cost']:.1f}% "
                f"(pretable +{100 * r['rope_cost_pretable']:.1f}%) | err ref {r.get('err_ref', float('nan')):.1e} "
                f"sdpa {r.get('err_sdpa', float('nan')):.1e} nan={r['nan']} | {r.get('kernel')}"
                + (f" | triton {r['ms_triton_pretable']:.3f} ms (x{r['vs_triton']:.2f} of it), its rope "
                   f"+{100 * r['triton_rope_cost']:.1f}%" if r.get("ms_triton_pretable") else "")
                + (f" | graph: ours {r['ms_rope_graph']:.4f}/{r['ms_rope_graph2']:.4f} ms rope-off "
                   f"{r['ms_norope_graph']:.4f}/{r['ms_norope_graph2']:.4f} sdpa {r.get('ms_sdpa_graph', float('nan')):.4f} "
                   f"x{r.get('vs_sdpa_graph', float('nan')):.2f} rope {100 * r['rope_cost_graph']:+.1f}%"
                   if r.get("ms_rope_graph") else ""))
    if r["kind"] == "decode":
        return (f"decode  b={r['batch']:4d} kv={r['kv']:6d} cfg={r['config']} sp={r['splits']} {r.get('extra') or ''} | "
                f"ours {r['ms_rope']:.3f} ms "
                f"{r['tbs_rope']:.2f} TB/s | rope-off {r['ms_norope']:.3f} | sdpa {r.get('ms_sdpa', float('nan')):.3f} ms "
                f"{r.get('tbs_sdpa', float('nan')):.2f} TB/s | x{r.get('vs_sdpa', float('nan')):.2f} | rope +{100 * r['rope_cost']:.1f}% "
                f"(pretable +{100 * r['rope_cost_pretable']:.1f}%) | err ref {r['err_ref']:.1e} sdpa {r.get('err_sdpa', float('nan')):.1e} nan={r['nan']}"
                + (f" | graph: ours {r['ms_rope_graph_min']:.3f} ms {r['tbs_rope_graph']:.2f} TB/s sdpa {r.get('ms_sdpa_graph', float('nan')):.3f} "
                   f"x{r.get('vs_sdpa_graph', float('nan')):.2f} rope +{100 * r['rope_cost_graph']:.1f}%" if r.get("ms_rope_graph") else ""))
    return (f"rerotate L={r['layers']} pages={r['pages']} rows={r['block_rows']} warps={r['num_warps']} | {r['ms']:.3f} ms "
            f"{r['tbs']:.2f} TB/s | torch copy {r['tbs_torch_copy']:.2f} TB/s | x{r['vs_copy']:.2f} of copy | "
            f"naive torch {r['ms_ref']:.3f} ms | err {r['err_k']:.1e} v_equal={r['v_equal']}")


def md_table(intro, header, body, align=None):
    """A paragraph (``None``: none), then a markdown table of ``body`` rows under ``header``
    (a row may be shorter: an error row), then a blank line. ``align``: a separator per
    column (``"---:"`` right-aligns), ``"---"`` for each by default."""
    align = align or ["---"] * len(header)
    return (([intro, ""] if intro is not None else []) + ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
            + ["| " + " | ".join(str(c) for c in row) + " |" for row in body] + [""])


def markdown(meta, rows):
    L = [f"Device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; {meta['date']}; "
         f"page size {meta['page_size']}; device-to-device copy {meta['copy_tbs']:.2f} TB/s.", ""]
    def default(r):
        return (r.get("config") is None and r.get("splits") is None and not r.get("extra")
                and r["page_size"] == meta["page_size"] and ("ms_sdpa" in r or "error" in r))

    pre = [derived(r) for r in rows if r["kind"] == "prefill" and default(r)]
    dec = [derived(r) for r in rows if r["kind"] == "decode" and default(r)]
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
                "and the same shape without the mask (TFLOP/s on all q x kv pairs; it does more work than the "
                "causal problem needs, so `ours/cuDNN unmasked`, a ratio of times, favours ours):",
                ["prefill q", "kv", "cuDNN causal ms", "TFLOP/s", "rel err vs flash", "cuDNN unmasked ms",
                 "TFLOP/s (all pairs)", "ours/cuDNN unmasked"],
                [[r["q"], r["kv"], f"{r['ms_cudnn']:.3f}", f"{r['tflops_cudnn']:.0f}", f"{r['err_cudnn']:.1e}",
                  f"{r['ms_cudnn_nomask']:.3f}", f"{r['tflops_cudnn_nomask']:.0f}", f"{100 * r['vs_cudnn_nomask']:.0f}%"]
                 for r in cu])
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
            L += md_table(
                "Decode replayed from one CUDA graph (as the engine runs it: no launch gaps, L2 not flushed; cos/sin "
                "table prebuilt; each side timed twice, interleaved, and the lower reading kept):",
                ["decode batch", "kv", "ours ms", "ours TB/s", "SDPA ms", "SDPA TB/s", "ours/SDPA", "rope off ms",
                 "RoPE cost"],
                [[r["batch"], r["kv"], f"{r['ms_rope_graph_min']:.3f}", f"{r['tbs_rope_graph']:.2f}",
                  f"{r['ms_sdpa_graph']:.3f}", f"{r['tbs_sdpa_graph']:.2f}", f"{100 * r['vs_sdpa_graph']:.0f}%",
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
    ch = [r for r in rows if r["kind"] == "decode_choice" and "error" not in r]
    if ch:
        loops = [k[3:-5] for k in ch[0] if k.startswith("ms_") and k.endswith("_rope")]
        L += md_table(
            "Decode from CUDA graphs as the engine calls it, by loop (`--decode-choice`): time in ms, then the RoPE "
            "cost against the same loop with RoPE off, and against the fastest RoPE-off loop:",
            ["batch", "kv", "pages"] + loops,
            [[r["batch"], r["kv"], "shared" if r["shared"] else "own"] + [
                f"{r[f'ms_{n}_rope']:.4f} ({100 * (r[f'ms_{n}_rope'] / r[f'ms_{n}_off'] - 1):+.1f}%, "
                f"{100 * (r[f'ms_{n}_rope'] / min(r[f'ms_{m}_off'] for m in loops) - 1):+.1f}%)" for n in loops]
             for r in ch])
    if cp:
        L += md_table(
            None,
            ["re-rotate copy", "ms", "TB/s", "torch copy, same bytes", "of copy bandwidth", "naive torch ms"],
            [[f"{r['layers']} layers x {r['pages']} pages of {r['page_size']} (rows {r['block_rows']}, warps "
              f"{r['num_warps']})", f"{r['ms']:.3f}", f"{r['tbs']:.2f}", f"{r['tbs_torch_copy']:.2f} TB/s",
              f"{100 * r['vs_copy']:.0f}%", f"{r['ms_ref']:.3f}"] for r in cp if "error" not in r])
    return "\n".join(L)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for kernels.json and kernels.md")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sweep", action="store_true", help="also time launch configurations and split counts")
    ap.add_argument("--sections", default="prefill,decode,copy")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--variants", action="store_true",
                    help="also time: cos/sin prefetch on, and pages of 64 tokens (a few shapes)")
    ap.add_argument("--qrot", action="store_true",
                    help="query rotated once per run of equal deltas (pages >= key tile): configs and page sizes")
    ap.add_argument("--flat", action="store_true",
                    help="the query-rotating kernel as one flat loop (qrot=2) against the run loop")
    ap.add_argument("--prefill-sweep", action="store_true",
                    help="prefill over pages of 64: tile shapes and pipeline stages (speed, RoPE cost)")
    ap.add_argument("--small-batch", action="store_true",
                    help="decode at batch 1-8 over pages of 64: split counts and key tiles")
    ap.add_argument("--run-loops", action="store_true",
                    help="prefill q >= 512 over 8k and 32k: the loop per run (qrot=1) against the one loop on "
                         "rotary halves (qrot=3), and where their RoPE cost goes (real deltas, one run, RoPE off)")
    ap.add_argument("--short-prefill", action="store_true",
                    help="prefill of 64 queries over 4k-32k keys from CUDA graphs: split counts, and the flat "
                         "float32 loop (qrot=2) against the default rotary-halves loop, RoPE on and off")
    ap.add_argument("--halves-configs", action="store_true",
                    help="decode at batch 32 and 128 from CUDA graphs, the rotary-halves loop (qrot=3): key "
                         "tiles, warps and stages, RoPE on and off; prefill of 64 queries with 3 stages")
    ap.add_argument("--decode-halves", action="store_true",
                    help="decode at batch >= 32 from CUDA graphs: the default flat loop (qrot=2, float32 "
                         "rotation, 255 registers for sm_90) against the rotary-halves loop (qrot=3, packed "
                         "16-bit rotation, 175 registers), RoPE on and off")
    ap.add_argument("--prefill-runs", action="store_true",
                    help="prefill at q >= 512 from CUDA graphs, Gluon and Triton: real deltas, every delta 0 (one "
                         "run) and RoPE off, to split the RoPE cost into its fixed part and its cost per run")
    ap.add_argument("--decode-choice", action="store_true",
                    help="decode at batch 32/64/128 over 4k-32k from CUDA graphs as the engine calls it, each row "
                         "over its own pages and all rows over the same pages: the flat loop against the "
                         "rotary-halves loop with 64- and 32-key tiles, RoPE on and off")
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
    meta = dict(device=torch.cuda.get_device_name() if not DRY else "cpu (dry run)", torch=torch.__version__, triton=triton.__version__,
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

    if args.sweep:
        big = not DRY
        pcfgs = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 128, 4, 2), (64, 64, 4, 2)]
        for nq, kv in (((512, 8192), (2048, 32768)) if big else ((40, 700),)):
            rows += run_prefill(nq, kv, ps, inv_freq, dev, configs=pcfgs if big else [(16, 16, 4, 1)])
        rows += run_prefill(64 if big else 8, 8192 if big else 700, ps, inv_freq, dev, splits=(4, 8, 16))
        dcfgs = [(0, 32, 4, 3), (0, 64, 4, 2), (0, 64, 4, 3), (0, 64, 4, 4), (0, 128, 4, 3), (0, 64, 8, 3),
                 (0, 128, 8, 3)]
        b32, kv16 = (32, 16384) if big else (3, 700)
        rows += run_decode(b32, kv16, ps, inv_freq, dev, configs=dcfgs if big else [(0, 32, 4, 1)])
        rows += run_decode(1, 32768 if big else 1200, ps, inv_freq, dev, splits=(8, 16, 32))
        rows += run_decode(b32, kv16, ps, inv_freq, dev, splits=(1, 2, 4))
        save()
        rows += run_decode(b32, kv16, 64, inv_freq, dev)
        rows += run_prefill(512 if big else 40, 8192 if big else 700, 64, inv_freq, dev)
        save()
        log(f"sweep done at {time.time() - t0:.0f}s")
    pre = PREFILL if not args.quick else [(512, 8192)]
    dec = DECODE if not args.quick else [(32, 16384)]
    if "prefill" in sections:
        for nq, kv in pre:
            rows += run_prefill(nq, kv, ps, inv_freq, dev, graphs=True)
        save()
    if args.short_prefill:
        big = not DRY
        for nq, kv in ([s_ for s_ in PREFILL if s_[0] < 512] if big else ((40, 700),)):
            rows += run_prefill(nq, kv, 64, inv_freq, dev, graphs=True, splits=(None, 4, 8, 16) if big else (None, 2))
            rows += run_prefill(nq, kv, 64, inv_freq, dev, graphs=True, splits=(None, 8) if big else (None,),
                                extra=dict(qrot=2), sdpa=False)
            save()
    if "decode" in sections:
        for b, kv in dec:
            rows += run_decode(b, kv, ps, inv_freq, dev, graphs=True)
        save()
    if args.variants:
        big = not DRY
        for nq, kv in (((512, 8192), (2048, 32768)) if big else ((40, 700),)):
            rows += run_prefill(nq, kv, ps, inv_freq, dev, extra=dict(prefetch=True))
            rows += run_prefill(nq, kv, 64, inv_freq, dev)
        for b, kv in (((32, 16384), (128, 4096)) if big else ((3, 700),)):
            rows += run_decode(b, kv, ps, inv_freq, dev, extra=dict(prefetch=True))
        for b, kv in (((1, 32768), (32, 16384), (128, 16384)) if big else ((3, 700),)):
            rows += run_decode(b, kv, 64, inv_freq, dev, graphs=True)
        save()
    if args.prefill_sweep:  # the query-rotating prefill's tile/stage choices: speed and RoPE cost
        big = not DRY
        cfgs = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 64, 8, 3)] if big else [(16, 16, 4, 1)]
        for nq, kv in (((512, 8192), (512, 32768), (2048, 8192), (2048, 32768)) if big else ((40, 700),)):
            rows += run_prefill(nq, kv, 64, inv_freq, dev, configs=cfgs)
        save()
    if args.small_batch:  # decode at batch 1-8 (the engine's batch-1 step): split counts, key tiles
        big = not DRY
        for b, kv in (((1, 4096), (1, 16384), (8, 4096)) if big else ((1, 700),)):
            rows += run_decode(b, kv, 64, inv_freq, dev, graphs=True, splits=(None, 8, 32, 64) if big else (None, 4))
            rows += run_decode(b, kv, 64, inv_freq, dev, graphs=True, configs=[(0, 32, 4, 3), (0, 32, 4, 2)] if big
                               else [(0, 32, 4, 1)], splits=(None, 64) if big else (None,))
        save()
    if args.run_loops:
        big = not DRY
        for nq, kv in ([s_ for s_ in PREFILL if s_[0] >= 512 and s_[1] >= 8192] if big else ((40, 700),)):
            for qr, cfg in ((1, (64, 64, 4, 3)), (3, (64, 64, 4, 2)), (3, (64, 64, 4, 3))):
                rows += run_prefill_diag(nq, kv, inv_freq, dev, qr, cfg if big else None)
            save()
    if args.decode_halves:
        big = not DRY
        for b, kv in ([s_ for s_ in DECODE if s_[0] >= 32] if big else ((3, 700),)):
            rows += run_decode(b, kv, 64, inv_freq, dev, graphs=True)
            rows += run_decode(b, kv, 64, inv_freq, dev, graphs=True, extra=dict(qrot=3))
        save()
    if args.prefill_runs:
        big = not DRY
        for nq, kv in ([s_ for s_ in PREFILL if s_[0] >= 512] if big else ((40, 700),)):
            rows += run_prefill_runs(nq, kv, inv_freq, dev, kernels=("gluon", "triton") if big else ("triton",),
                                     rounds=3 if big else 1)
            save()
    if args.decode_choice:
        big = not DRY
        for shared in (False, True):
            for b in ((32, 64, 128) if big else (3,)):
                for kv in ((4096, 16384, 32768) if big else (700,)):
                    rows += run_decode_choice(b, kv, 64, inv_freq, dev, shared, loops=DECODE_LOOPS if big else (
                        ("flat", None, None), ("halves16", 3, (0, 16, 4, 1))))
                    save()
    if args.halves_configs:
        big = not DRY
        for nq, kv in ([s_ for s_ in PREFILL if s_[0] < 512] if big else ((40, 700),)):
            rows += run_prefill(nq, kv, 64, inv_freq, dev, graphs=True, sdpa=False,
                                configs=[(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3)] if big else [(16, 16, 4, 1)],
                                splits=(None, 6, 12) if big else (None,))
        save()
        for b, kv in (DECODE if big else ((3, 700),)):
            rows += run_decode(b, kv, 64, inv_freq, dev, graphs=True, sdpa=False)
            rows += run_decode(b, kv, 64, inv_freq, dev, graphs=True, sdpa=False, extra=dict(qrot=3),
                               configs=[(0, 64, 4, 3), (0, 32, 4, 3), (0, 32, 4, 4)] if big else [(0, 16, 4, 1)])
            save()
    if args.flat:
        big = not DRY
        for nq, kv in ([s_ for s_ in PREFILL if s_[0] >= 512] if big else ((40, 700),)):
            rows += run_prefill(nq, kv, 64, inv_freq, dev, extra=dict(qrot=2))
        save()
        for b, kv in ([s_ for s_ in DECODE if s_[0] >= 32] if big else ((3, 700),)):
            rows += run_decode(b, kv, 64, inv_freq, dev, graphs=True, extra=dict(qrot=2))
        save()
    if args.qrot:
        big = not DRY
        pq = (((512, 8192), (2048, 32768)) if big else ((40, 700),))
        for nq, kv in pq:  # the old path (key tiles rotated), then the query-rotating kernel
            rows += run_prefill(nq, kv, 16, inv_freq, dev, extra=dict(qrot=False))
            rows += run_prefill(nq, kv, 64, inv_freq, dev,
                                configs=[(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3)]
                                if big else [(16, 16, 4, 1)])
            rows += run_prefill(nq, kv, 128, inv_freq, dev,
                                configs=[(128, 128, 8, 2), (128, 128, 8, 3)] if big else [(16, 32, 4, 1)])
            save()
        for nq, kv in (PREFILL if big else ((40, 700),)):
            rows += run_prefill(nq, kv, 64, inv_freq, dev)
        save()
        for b, kv in (DECODE if big else ((3, 700),)):
            rows += run_decode(b, kv, 64, inv_freq, dev, graphs=True)
        save()
        for b, kv in (((32, 16384), (128, 16384)) if big else ((3, 700),)):
            rows += run_decode(b, kv, 128, inv_freq, dev, graphs=True)
            rows += run_decode(b, kv, 64, inv_freq, dev, graphs=True,
                               configs=[(0, 64, 4, 2), (0, 64, 8, 3), (0, 32, 4, 3)] if big else [(0, 32, 4, 1)])
        save()
    if "copy" in sections:
        variants = [(None, None)]
        rows += run_copy(inv_freq, dev, copy_tbs, ps=ps, variants=variants,
                         **(dict(n_layers=2, n=4) if DRY else {}))
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
