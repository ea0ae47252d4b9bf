"""``kernel_bench.py``'s problems: Llama 3's RoPE frequencies, sequences laid out in a shuffled
page pool (and the same keys contiguous for SDPA), and the SDPA flash baseline."""
from __future__ import annotations

import math
import random

import torch

from benchmarks.attention import HKV, D
from lazyllm.kernels import reference as ref

DTYPE = torch.bfloat16
SCALE = D ** -0.5


def llama3_inv_freq(dim=128, theta=500000.0, factor=8.0, low=1.0, high=4.0, orig=8192):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = orig / low, orig / high
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    mid = (wavelen <= low_wl) & (wavelen >= high_wl)
    scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return scaled.to(torch.float32)


class Paged:
    """Sequences laid out in a shuffled page pool, and the same keys contiguous for SDPA.

    SDPA-side K/V (``(batch, HKV, kv, D)``, keys at their final positions) are drawn first;
    the cache stores each cached chunk's keys rotated back by its delta (as if encoded
    alone), own tokens as they are. So both kernels see the same logical keys."""

    def __init__(self, batch, kv, n_own, page_size, inv_freq, seed=0, dev="cuda", dtype=DTYPE):
        g = random.Random(seed)
        torch.manual_seed(seed)
        self.batch, self.kv, self.page_size = batch, kv, page_size
        self.k_sdpa = torch.randn(batch, HKV, kv, D, device=dev, dtype=dtype)
        self.v_sdpa = torch.randn(batch, HKV, kv, D, device=dev, dtype=dtype)
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
        self.k_cache = torch.randn(n_pages + 7, page_size, HKV, D, device=dev, dtype=dtype)
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
    if q.device.type == "cpu":  # a stand-in with the same mask, for --dry-run only
        lq, lk = q.shape[2], k.shape[2]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if causal else None
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1).float() for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=SCALE)
        return out.to(q.dtype)
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=causal, scale=SCALE)[0]
    except RuntimeError as e:  # no native GQA: expand heads (more bytes for SDPA; reported)
        print(f"sdpa flash op refused GQA shapes ({e!r:.120}); expanding K/V heads", flush=True)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=causal, scale=SCALE)[0]
