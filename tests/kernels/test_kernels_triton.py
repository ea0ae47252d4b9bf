"""The Triton kernels against their torch twins in ``lazyllm.kernels.reference``.

On CPU the real kernels run in Triton's interpreter. The interpreter is chosen when a
kernel is *defined*, so this module loads its own copy of the kernel package
``kernels/triton/`` with ``TRITON_INTERPRET=1`` set only for that import: the result does not depend on which
test modules ran before, and the package's own module (used by the engine) is untouched.
The compiled kernels on CUDA: ``tests/gpu/test_kernels_compiled.py``.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from lazyllm.kernels.options import KernelOptions
from lazyllm.kernels.reference import paged_attention_ref, rerotate_copy_ref, write_kv_ref
from tests._triton_load import load_kernel_module

triton = pytest.importorskip("triton", reason="triton is not installed")


def _load_kernels(interpret: bool):
    """A private copy of the kernel package ``kernels/triton/``, compiled or interpreted."""
    return load_kernel_module("triton", interpret)


ta = _load_kernels(interpret=True)


def test_module_is_interpreted():
    """Guards the premise of this file: the kernels below really run in the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(ta.prefill._paged_attn_fwd, InterpretedFunction)


_CPU_BACKEND_SCRIPT = """
import os, sys, torch
assert "TRITON_INTERPRET" not in os.environ
import lazyllm.kernels.triton as compiled  # the package's module first, compiled
from triton.runtime.interpreter import InterpretedFunction
assert not isinstance(compiled.prefill._paged_attn_fwd, InterpretedFunction)
from lazyllm.kernels.loader import triton_kernels
from lazyllm.kernels.reference import paged_attention_ref
from lazyllm.model.attention import AttentionMetadata, make_backend
backend = make_backend("triton", torch.device("cpu"))
assert backend.name == "triton" and isinstance(backend.kernels.prefill._paged_attn_fwd, InterpretedFunction)
assert triton_kernels() is compiled and "TRITON_INTERPRET" not in os.environ
g = torch.Generator().manual_seed(0)
pages, ps, hkv, grp, d = 6, 16, 2, 2, 32
k, v = torch.randn(pages, ps, hkv, d, generator=g), torch.randn(pages, ps, hkv, d, generator=g)
q = torch.randn(20, hkv * grp, d, generator=g)
args = dict(q=q, q_pos=torch.arange(40, 60), cu_seqlens_q=torch.tensor([0, 20], dtype=torch.int32),
            k_cache=k, v_cache=v, block_table=torch.tensor([[4, 1, 3, 0]], dtype=torch.int32),
            block_pos=torch.tensor([[0, 16, 32, 48]], dtype=torch.int32),
            block_delta=torch.tensor([[7, 7, 0, 0]], dtype=torch.int32),
            block_len=torch.tensor([[16, 16, 16, 12]], dtype=torch.int32),
            inv_freq=1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), sm_scale=d ** -0.5)
meta = AttentionMetadata(positions=args["q_pos"], cu_seqlens_q=args["cu_seqlens_q"], slot_mapping=None,
                         block_table=args["block_table"], block_pos=args["block_pos"],
                         block_delta=args["block_delta"], block_len=args["block_len"], max_seqlen_q=20)
out = backend.run(q, meta, k, v, args["inv_freq"], args["sm_scale"], backend.plan(meta, args["inv_freq"]))
ref = paged_attention_ref(**args)
err = ((out - ref).norm() / ref.norm()).item()
assert err < 1e-4, err
print("ok", err)
"""


def test_engine_cpu_backend_is_interpreted_whatever_was_imported_first():
    """The engine's Triton backend on CPU runs an interpreted copy of the kernels even when
    the package's compiled module was imported first (a fresh process without
    ``TRITON_INTERPRET``), matches the reference, and leaves the compiled module and the
    environment as they were."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _CPU_BACKEND_SCRIPT], capture_output=True, text=True, env=env,
                       timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout[-1000:] + r.stderr[-3000:]


# ----------------------------------------------------------------------------------------
# random paged batches
# ----------------------------------------------------------------------------------------


def _inv_freq(rotary_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


class _Pool:
    """Hands out shuffled page ids; every page starts as NaN so that a read of an unused
    page or of a slot past a page's length shows up in the output."""

    def __init__(self, num_pages, page_size, hkv, d, dtype, gen):
        self.k = torch.full((num_pages, page_size, hkv, d), float("nan"), dtype=dtype)
        self.v = torch.full_like(self.k, float("nan"))
        self.free = list(range(num_pages))
        gen.shuffle(self.free)
        self.page_size = page_size

    def take(self, n_tokens):
        pages = []
        for i in range(0, n_tokens, self.page_size):
            p = self.free.pop()
            n = min(self.page_size, n_tokens - i)
            self.k[p, :n] = torch.randn(n, *self.k.shape[2:]).to(self.k.dtype)
            self.v[p, :n] = torch.randn(n, *self.v.shape[2:]).to(self.v.dtype)
            pages.append((p, n))
        return pages


def _make_batch(seqs, *, page_size=16, hkv=2, group=2, d=64, rotary_dim=None, dtype=torch.float32,
                seed=0, pad_extra=2):
    """A varlen batch over a shared page pool.

    ``seqs`` is a list of sequences; each is ``(segments, n_queries)`` where ``segments``
    lists ``(start_pos, length, delta)`` runs of keys (a cached chunk placed at
    ``start_pos`` with rotation ``delta``, or the sequence's own tokens with ``delta=0``),
    and the queries sit at the last ``n_queries`` positions of the last segment (or at
    position 0.. when there is no segment). Tables get padding entries (length 0,
    page id pointing at a NaN page) in random places and at the end.
    """
    gen = random.Random(seed)
    torch.manual_seed(seed)
    n_tokens = sum(length for segs, _ in seqs for _, length, _ in segs)
    n_pages = n_tokens // page_size + 2 * sum(len(s) for s, _ in seqs) + 8
    pool = _Pool(n_pages, page_size, hkv, d, dtype, gen)
    nan_page = pool.free[0]  # never filled
    rows, qpos, cu = [], [], [0]
    for segs, nq in seqs:
        entries = []
        for start, length, delta in segs:
            off = 0
            for p, n in pool.take(length):
                entries.append((p, start + off, delta, n))
                off += n
        for _ in range(gen.randint(0, pad_extra)):
            entries.insert(gen.randint(0, len(entries)), (nan_page, 0, 0, 0))
        rows.append(entries)
        if segs:
            end = segs[-1][0] + segs[-1][1]
        else:
            end = nq
        qpos += list(range(end - nq, end))
        cu.append(cu[-1] + nq)
    max_blocks = max(1, max(len(r) for r in rows)) + gen.randint(0, 2)
    shape = (len(seqs), max_blocks)
    bt = torch.full(shape, nan_page, dtype=torch.int32)
    bpos = torch.zeros(shape, dtype=torch.int32)
    bdelta = torch.zeros(shape, dtype=torch.int32)
    blen = torch.zeros(shape, dtype=torch.int32)
    for b, entries in enumerate(rows):
        for j, (p, pos, delta, n) in enumerate(entries):
            bt[b, j], bpos[b, j], bdelta[b, j], blen[b, j] = p, pos, delta, n
    rd = d if rotary_dim is None else rotary_dim
    total_q = cu[-1]
    q = torch.randn(total_q, hkv * group, d).to(dtype)
    return dict(
        q=q, q_pos=torch.tensor(qpos, dtype=torch.int64), cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        k_cache=pool.k, v_cache=pool.v, block_table=bt, block_pos=bpos, block_delta=bdelta,
        block_len=blen, inv_freq=_inv_freq(rd), sm_scale=d ** -0.5,
    )


def _tol(dtype):
    return dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=2e-5, rtol=2e-5)


_OPTIONS = {f.name for f in dataclasses.fields(KernelOptions)}


def _check_attention(batch, *, max_seqlen_q=None, num_splits=None, config=None, use_rope=True, mod=None,
                     window=None, **kw):
    mod = mod or ta
    ref = paged_attention_ref(**batch, window=window)
    out = torch.full_like(batch["q"], float("nan"))  # poisoned: every element must be written
    opts = KernelOptions(num_splits=num_splits, config=config, **{k: kw.pop(k) for k in list(kw) if k in _OPTIONS})
    if window is not None:
        kw["window"] = window
    got = mod.paged_attention_triton(**batch, out=out, max_seqlen_q=max_seqlen_q, use_rope=use_rope,
                                     options=opts, **kw)
    assert got is out
    assert not torch.isnan(got).any(), "unwritten or NaN output"
    torch.testing.assert_close(got.float(), ref.float(), **_tol(batch["q"].dtype))
    return got, ref


def _chunks(gen, n, start, lo=5, hi=40):
    """``n`` cached chunks of random length placed one after another from ``start``, each
    with a random nonzero delta (as if encoded alone at local positions 0..L-1)."""
    segs, pos = [], start
    for _ in range(n):
        length = gen.randint(lo, hi)
        segs.append((pos, length, pos if pos else gen.randint(1, 5000)))
        pos += length
    return segs, pos


# ----------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------

# (group, head_dim, rotary_dim, dtype, page_size, config): GQA ratios 1/3/4/8, head dims
# 64/128, partial rotary, both dtypes, pages of 16 and 32, the default tile shape and
# small tiles (many query and key tiles, a tile smaller than a page).
PREFILL_CASES = [
    (1, 64, None, torch.float32, 16, None),
    (3, 64, 32, torch.float16, 16, (16, 16, 4, 1)),
    (4, 128, None, torch.float16, 32, None),
    (8, 64, None, torch.float32, 32, (32, 16, 4, 1)),
    (4, 128, 64, torch.float32, 16, (16, 32, 4, 1)),
    (2, 64, 48, torch.float16, 16, (32, 64, 4, 1)),  # rotary half 24: padded to 32
    (2, 16, None, torch.float32, 16, None),  # the tiny test models' head_dim
]


def _case_id(c):
    g, d, rd, dt, ps, cfg = c
    return f"g{g}-d{d}-rd{rd or d}-{str(dt)[6:]}-ps{ps}-{'cfg' if cfg else 'default'}"


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_case_id)
def test_prefill_isolated_chunks(case):
    """Chunks encoded alone: each sequence's table lists only its own pages (delta 0)."""
    g, d, rd, dtype, ps, cfg = case
    gen = random.Random(11)
    seqs = [([(0, n, 0)], n) for n in (gen.randint(20, 45), 1, gen.randint(33, 40))]
    seqs.insert(1, ([(0, 9, 0)], 0))  # a sequence with no queries this step
    batch = _make_batch(seqs, page_size=ps, hkv=2, group=g, d=d, rotary_dim=rd, dtype=dtype, seed=1)
    _check_attention(batch, config=cfg)


@pytest.mark.parametrize("case", PREFILL_CASES[:4], ids=_case_id)
def test_prefill_prefix_context(case):
    """``prefix`` chunk context: the table lists the shared prefix, then the chunk's own pages."""
    g, d, rd, dtype, ps, cfg = case
    gen = random.Random(12)
    seqs = []
    for _ in range(3):
        p, n = gen.randint(5, 30), gen.randint(10, 40)
        seqs.append(([(0, p, 0), (p, n, 0)], n))
    batch = _make_batch(seqs, page_size=ps, hkv=2, group=g, d=d, rotary_dim=rd, dtype=dtype, seed=2)
    _check_attention(batch, config=cfg)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_case_id)
def test_prefill_suffix_over_cached_chunks(case):
    """A suffix over many cached chunks placed at nonzero deltas, then its own pages."""
    g, d, rd, dtype, ps, cfg = case
    gen = random.Random(13)
    seqs = []
    for nc, nq in ((4, 20), (1, 3), (6, 33)):
        chunks, pos = _chunks(gen, nc, 0, lo=3, hi=30)
        seqs.append(([(0, 7, 0)] + [(s + 7, n, dl) for s, n, dl in chunks] + [(pos + 7, nq + 2, 0)], nq))
    batch = _make_batch(seqs, page_size=ps, hkv=2, group=g, d=d, rotary_dim=rd, dtype=dtype, seed=3)
    assert (batch["block_delta"] != 0).sum() > 5
    _check_attention(batch, config=cfg)


def test_prefill_splits_and_unsorted_table():
    """Any table order is exact (the scan bounds are order-free), with split key ranges."""
    gen = random.Random(14)
    chunks, pos = _chunks(gen, 5, 0, lo=10, hi=40)
    seqs = [(chunks + [(pos, 30, 0)], 25), (chunks[:2] + [(200, 20, 0)], 20)]
    batch = _make_batch(seqs, page_size=16, hkv=1, group=4, d=64, dtype=torch.float32, seed=4)
    for b in range(2):  # shuffle each row's entries, padding included
        perm = torch.randperm(batch["block_table"].shape[1])
        for key in ("block_table", "block_pos", "block_delta", "block_len"):
            batch[key][b] = batch[key][b][perm]
    for splits in (1, 3, 50):
        _check_attention(batch, num_splits=splits, config=(16, 16, 4, 1))


@pytest.mark.parametrize("ps,cfg", [(16, (16, 32, 4, 1)), (64, (16, 32, 4, 1))])
def test_cos_sin_prefetch_variant(ps, cfg):
    """The non-default launch variants (cos/sin of the next tile loaded early; per-slot
    gather) compute the same function."""
    gen = random.Random(20)
    chunks, pos = _chunks(gen, 4, 0, lo=20, hi=70)
    batch = _make_batch([(chunks + [(pos, 30, 0)], 30), (chunks[:2], 1)], page_size=ps, hkv=2, group=2, d=64,
                        rotary_dim=32, dtype=torch.float32, seed=11)
    _check_attention(batch, config=cfg, prefetch=True)
    _check_attention(batch, config=cfg, cs_per_page=False)
    dec = dict(batch, q=batch["q"][:2], q_pos=batch["q_pos"][:2],
               cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32))
    _check_attention(dec, max_seqlen_q=1, prefetch=True)


def test_prefill_page_larger_than_tile():
    """A key tile that covers part of one page (page 64, tile 16)."""
    gen = random.Random(15)
    chunks, pos = _chunks(gen, 3, 0, lo=40, hi=90)
    batch = _make_batch([(chunks + [(pos, 20, 0)], 20)], page_size=64, hkv=2, group=2, d=64,
                        dtype=torch.float32, seed=5)
    _check_attention(batch, config=(16, 16, 4, 1))


def test_queries_that_see_nothing_output_zero():
    """Rows with no visible key: a table of padding only, and queries placed before every
    key. Both give 0, as the reference does."""
    seqs = [([], 3), ([(50, 20, 7)], 2), ([(0, 12, 0)], 4)]
    batch = _make_batch(seqs, page_size=16, hkv=2, group=2, d=64, dtype=torch.float32, seed=6)
    batch["q_pos"][3:5] = torch.tensor([10, 49])  # before the chunk at 50..69
    got, ref = _check_attention(batch, config=(16, 16, 4, 1))
    assert got[:5].abs().max() == 0
    got, _ = _check_attention(batch, max_seqlen_q=4, num_splits=4)  # decode path + merge
    assert got[:5].abs().max() == 0


def test_use_rope_false_and_precomputed_table():
    gen = random.Random(16)
    chunks, pos = _chunks(gen, 3, 0)
    batch = _make_batch([(chunks + [(pos, 20, 0)], 20)], page_size=16, hkv=2, group=2, d=64,
                        dtype=torch.float32, seed=7)
    cos, sin, runs = ta.rope_table(batch["block_delta"], batch["inv_freq"])
    ref = paged_attention_ref(**batch)
    got = ta.paged_attention_triton(**batch, rope=(cos, sin))
    torch.testing.assert_close(got, ref, **_tol(torch.float32))
    batch["block_delta"].zero_()  # all deltas 0: rotation off is the same function
    _check_attention(batch, use_rope=False)


def test_delta_runs_matches_naive():
    gen = torch.Generator().manual_seed(3)
    for n in (1, 2, 7, 33):
        d = torch.randint(0, 3, (4, n), generator=gen, dtype=torch.int32)
        got = ta.delta_runs(d)
        for b in range(4):
            for e in range(n):
                nxt = next((j for j in range(e + 1, n) if d[b, j] != d[b, e]), n)
                assert int(got[b, e]) == nxt, (b, e, d[b].tolist(), got[b].tolist())


# (group, head_dim, rotary_dim, dtype, page_size, config): key tiles inside one page, so
# the kernel rotates the query once per run of equal deltas (the run loops); 1, 2 and 4 tiles per page
QROT_CASES = [
    (4, 128, None, torch.float16, 64, (32, 64, 4, 1)),
    (3, 64, 32, torch.float32, 32, (16, 16, 4, 1)),
    (1, 64, 48, torch.float16, 64, (16, 16, 4, 1)),
    (8, 64, None, torch.float32, 16, (32, 16, 4, 1)),
]


@pytest.mark.parametrize("case", QROT_CASES, ids=_case_id)
@pytest.mark.parametrize("splits,loop", [(None, "per_run"), (1, "per_run"), (3, "per_run"), (None, "flat_runs"),
                                        (3, "flat_runs"), (None, "halves"), (1, "halves"), (3, "halves")])
def test_query_rotation_per_run(case, splits, loop):
    """Prefix, chunks at random deltas (two neighbours sharing one delta, so a run spans
    chunks), then the queries' own pages; prefill, decode, split key ranges. Loops: a
    loop per run, one flat loop, one loop on the query's rotary halves (fully rotary
    heads only: refused otherwise)."""
    g, d, rd, dtype, ps, cfg = case
    if loop == "halves" and rd is not None and rd != d:
        batch = _make_batch([([(0, 9, 0), (9, 30, 0)], 5)], page_size=ps, hkv=2, group=g, d=d, rotary_dim=rd,
                            dtype=dtype, seed=21)
        with pytest.raises(ValueError, match="fully rotary"):
            ta.paged_attention_triton(**batch, options=KernelOptions(config=cfg, loop="halves"))
        return
    gen = random.Random(21)
    seqs = []
    for nc, nq in ((4, 17), (0, 5), (3, 1)):
        chunks, pos = _chunks(gen, nc, 9, lo=3, hi=80)
        if len(chunks) > 2:
            chunks[2] = (chunks[2][0], chunks[2][1], chunks[1][2])  # encoded together: one delta
        seqs.append(([(0, 9, 0)] + chunks + [(pos, nq + gen.randint(0, 20), 0)], nq))
    batch = _make_batch(seqs, page_size=ps, hkv=2, group=g, d=d, rotary_dim=rd, dtype=dtype, seed=21)
    _check_attention(batch, config=cfg, num_splits=splits, loop=loop)
    # RoPE off: the same function as every delta 0 (the loop carries the unrotated query)
    _check_attention(dict(batch, block_delta=torch.zeros_like(batch["block_delta"])), config=cfg,
                     num_splits=splits, loop=loop, use_rope=False)
    one = [([(0, 9, 0)] + _chunks(gen, 5, 9, lo=3, hi=80)[0], 1) for _ in range(3)]
    for s_, _ in one:
        last = s_[-1]
        s_.append((last[0] + last[1], 4, 0))
    dec = _make_batch(one, page_size=ps, hkv=2, group=g, d=d, rotary_dim=rd, dtype=dtype, seed=22)
    _check_attention(dec, max_seqlen_q=1, num_splits=splits, loop=loop, config=cfg)
    if ps >= 64:  # the default decode tile (64 keys) fits a page: a run loop is the default
        _check_attention(dec, max_seqlen_q=1, num_splits=splits)


@pytest.mark.parametrize("dtype,rd,ps,halves", [(torch.float16, None, 64, True), (torch.float32, None, 64, False),
                                               (torch.float16, 64, 64, False), (torch.float16, None, 16, False)],
                         ids=["fp16-full-ps64", "fp32", "partial-rotary", "ps16"])
def test_default_prefill_loop(dtype, rd, ps, halves, monkeypatch):
    """The launcher's default for a prefill (more than 64 query rows per KV head): the
    rotary-halves loop for head_dim 128 in 16-bit with a fully rotary head and pages of at
    least 64, another loop otherwise; the reference's result either way."""
    calls = []
    config = ta.launcher._prefill_config
    monkeypatch.setattr(ta.launcher, "_prefill_config", lambda *a: calls.append(a[-1]) or config(*a))
    gen = random.Random(40)
    chunks, pos = _chunks(gen, 2, 0, lo=20, hi=40)
    batch = _make_batch([(chunks + [(pos, 24, 0)], 20)], page_size=ps, hkv=2, group=4, d=128, rotary_dim=rd,
                        dtype=dtype, seed=41)
    _check_attention(batch)
    assert calls and calls[-1] == halves  # the launch configuration's lookup names the loop


class _LaunchSpy:
    """Stands in for a jitted kernel: records each launch's keyword arguments (and grid),
    then launches ``fn`` (``None``: launches nothing)."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        launch = self.fn[grid] if self.fn is not None else None

        def run(*a, **k):
            self.calls.append(dict(k, grid=grid))
            return launch(*a, **k) if launch is not None else None

        return run


def _short_seqs(gen, batch_n, n_chunks, nq, own):
    """``batch_n`` sequences of ``n_chunks`` chunks of 20-50 tokens at random deltas, then
    ``own`` tokens of their own, the last ``nq`` of them queries."""
    seqs = []
    for _ in range(batch_n):
        chunks, pos = _chunks(gen, n_chunks, 0, lo=20, hi=50)
        seqs.append((chunks + [(pos, own, 0)], nq))
    return seqs


@pytest.mark.parametrize("mode,dtype,rd,ps,batch_n,want", [
    ("auto", torch.float16, None, 64, 1, (3, 64)),  # 2 programs < 8 SMs (the interpreter's count): 64-key tiles
    ("auto", torch.float16, None, 64, 5, (3, 32)),  # 10 programs >= 8: 32-key tiles
    ("auto", torch.float16, None, 32, 5, (3, 32)),  # the 32-key tile fits a page of 32
    ("auto", torch.float32, None, 64, 5, (2, 64)),  # float32: the flat loop
    ("auto", torch.float16, 64, 64, 5, (2, 64)),    # partial rotary: the flat loop
    ("auto", torch.float16, None, 16, 5, None),     # pages under the tile: no run loop
    ("off", torch.float16, None, 64, 5, (2, 64)),   # the default: the flat loop where the halves could run
], ids=["fp16-few", "fp16-wide", "fp16-ps32", "fp32", "partial-rotary", "ps16", "default-flat"])
@pytest.mark.parametrize("nq", [1, 9])
def test_short_halves_choice(mode, dtype, rd, ps, batch_n, want, nq, monkeypatch):
    """With ``KernelOptions(short_halves="auto")`` the short path (decode, and up to 64 query
    rows per KV head) runs the rotary-halves loop (QROT 3) for head_dim 128 in 16-bit with a
    fully rotary head, 64-key tiles while there are fewer programs than SMs and 32-key tiles
    from there; the flat loop otherwise, and by default (``"off"``); the reference's result
    either way."""
    calls = []
    monkeypatch.setattr(ta.launcher, "_paged_attn_fwd", _LaunchSpy(ta.launcher._paged_attn_fwd, calls))
    seqs = _short_seqs(random.Random(60 + batch_n), batch_n, 2, nq, nq + 3)
    batch = _make_batch(seqs, page_size=ps, hkv=2, group=4, d=128, rotary_dim=rd, dtype=dtype, seed=61)
    _check_attention(batch, max_seqlen_q=nq, short_halves=mode)
    if want is None:  # no run loop: the per-page decode kernel, or the key-rotating loop
        assert not calls if nq == 1 else calls[-1]["QROT"] == 0, calls[-1:]
        return
    assert calls, "the general kernel did not run"
    assert (calls[-1]["QROT"], calls[-1]["BLOCK_N"]) == want


@pytest.mark.parametrize("dtype,loop,lookahead", [(torch.float16, "halves", True), (torch.float32, "halves", False),
                                                   (torch.float16, "flat_runs", True),
                                                   (torch.float32, "flat_runs", False),
                                                   (torch.float32, "per_run", False)])
def test_run_coefficients_from_delta(dtype, loop, lookahead):
    """The run loops (per run, flat, halves) computing each run's cos/sin from its delta in the
    kernel (range reduction, then cos/sin) instead of loading the table rows, with and
    without the next run's head loaded a run ahead: the reference's result for deltas up
    to ~1e5 positions (angles up to ~1e5 rad), split and unsplit."""
    gen = random.Random(50)
    seqs = []
    for start, nc, nq in ((9, 3, 17), (40000, 4, 5), (97000, 2, 1)):
        chunks, pos = _chunks(gen, nc, start, lo=3, hi=80)
        seqs.append(([(0, 9, 0)] + chunks + [(pos, nq + 7, 0)], nq))
    batch = _make_batch(seqs, page_size=64, hkv=2, group=4, d=128, dtype=dtype, seed=51)
    assert int(batch["block_delta"].max()) > 90000
    for splits in (None, 3):
        _check_attention(batch, config=(32, 64, 4, 1), num_splits=splits, loop=loop, coef_from_delta=True,
                         coef_lookahead=lookahead)
    # the kernel reads block_delta itself: a view whose last dim is strided is copied first
    bd = batch["block_delta"]
    strided = torch.stack([bd, bd + 1], -1)[..., 0]
    assert strided.stride(-1) != 1
    _check_attention(dict(batch, block_delta=strided), config=(32, 64, 4, 1), loop=loop, coef_from_delta=True,
                     coef_lookahead=lookahead)


def test_run_loop_needs_tile_inside_page():
    gen = random.Random(22)
    chunks, pos = _chunks(gen, 2, 0)
    batch = _make_batch([(chunks, 3)], page_size=16, hkv=2, group=2, d=64, dtype=torch.float32, seed=23)
    with pytest.raises(ValueError, match="query-rotating loop"):
        ta.paged_attention_triton(**batch, options=KernelOptions(config=(16, 32, 4, 1), loop="per_run"))


# ----------------------------------------------------------------------------------------
# sliding windows (Gemma 3's local layers)
# ----------------------------------------------------------------------------------------

# (group, head_dim, rotary_dim, dtype, page_size, config, loop): every key-tile loop: the
# key-rotating one and the decode kernel (pages smaller than the key tile), the run loop, the
# flat run loop and the rotary-halves loop (key tiles inside a page); GQA 1, 2 and 4
WINDOW_CASES = [
    (1, 32, None, torch.float32, 8, (16, 16, 4, 1), None),
    (4, 32, 16, torch.float16, 16, (16, 16, 4, 1), "per_run"),
    (2, 32, None, torch.float16, 16, (16, 16, 4, 1), "flat_runs"),
    (2, 32, None, torch.float32, 32, (16, 16, 4, 1), "halves"),
]


def _window_id(c):
    return f"{_case_id(c[:6])}-{c[6] or 'per_tile'}"


def _window_seqs(gen, window, nq):
    """Sequences whose key spans are shorter than, equal to and longer than ``window``:
    a chunk prefilled alone (its queries cross the window's edge), and a suffix over a
    prefix and cached chunks of those lengths at random deltas (``nq`` queries each)."""
    seqs = [([(0, 3 * window + 5, 0)], min(nq, 3 * window + 5) if nq > 1 else 1),
            ([(0, window, 0)], min(nq, window)), ([(0, window - 3, 0)], min(nq, window - 3))]
    chunks, pos = [], 5
    for length in (window - 2, window, window + 17):
        chunks.append((pos, length, gen.randint(1, 3000)))
        pos += length
    seqs.append(([(0, 5, 0)] + chunks + [(pos, nq + 3, 0)], nq))
    return seqs


@pytest.mark.parametrize("case", WINDOW_CASES, ids=_window_id)
@pytest.mark.parametrize("window", [8, 21])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_window_prefill_and_decode(case, window, splits):
    """A sliding window against ``paged_attention_ref(..., window=)``: prefill and decode,
    chunks shorter than, equal to and longer than the window, queries on both sides of its
    edge, split key ranges; pages outside every window are NaN-poisoned padding or skipped."""
    g, d, rd, dtype, ps, cfg, loop = case
    gen = random.Random(window * 7 + g)
    kw = dict(config=cfg, num_splits=splits, window=window)
    if loop:
        kw["loop"] = loop
    batch = _make_batch(_window_seqs(gen, window, 30), page_size=ps, hkv=2, group=g, d=d, rotary_dim=rd,
                        dtype=dtype, seed=window)
    assert (batch["block_delta"] != 0).any()
    got, ref = _check_attention(batch, **kw)
    assert not torch.allclose(ref, paged_attention_ref(**batch))  # the window changed the answer
    dec = _make_batch(_window_seqs(gen, window, 1), page_size=ps, hkv=2, group=g, d=d, rotary_dim=rd,
                      dtype=dtype, seed=window + 1)
    _check_attention(dec, max_seqlen_q=1, **kw)


@pytest.mark.parametrize("max_seqlen_q", [1, None])
def test_window_any_table_order(max_seqlen_q):
    """Table entries in random order (padding included): the window's scan bounds are
    order-free, so the result is exact, with and without split key ranges."""
    gen = random.Random(5)
    nq = 1 if max_seqlen_q == 1 else 12
    batch = _make_batch(_window_seqs(gen, 10, nq), page_size=8, hkv=1, group=2, d=32, dtype=torch.float32,
                        seed=6)
    for b in range(batch["block_table"].shape[0]):
        perm = torch.randperm(batch["block_table"].shape[1])
        for key in ("block_table", "block_pos", "block_delta", "block_len"):
            batch[key][b] = batch[key][b][perm]
    for splits in (1, 4):
        _check_attention(batch, max_seqlen_q=max_seqlen_q, num_splits=splits, config=(16, 16, 4, 1), window=10)
        _check_attention(batch, max_seqlen_q=max_seqlen_q, num_splits=splits, config=(16, 8, 4, 1), window=10,
                         loop="flat_runs")


def test_window_skips_tiles_outside_it(monkeypatch):
    """The key range starts at the first tile a window reaches: with one long sequence,
    split-K by default, and the splits cover only the window's tiles (the launcher counts
    them), and the answer is the reference's."""
    seen = []
    real = ta.launcher.plan_launch
    monkeypatch.setattr(ta.launcher, "plan_launch", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    gen = random.Random(9)
    chunks, pos = _chunks(gen, 10, 0, lo=30, hi=40)
    batch = _make_batch([(chunks + [(pos, 6, 0)], 1)], page_size=16, hkv=1, group=2, d=32, dtype=torch.float32,
                        seed=9)
    _check_attention(batch, max_seqlen_q=1, window=20)
    _check_attention(batch, max_seqlen_q=1)
    assert seen[0].window == 20 and seen[1].window == 0
    assert seen[0].num_splits < seen[1].num_splits
    # pages wholly before the window (key tile == page) are never read: NaN there changes nothing
    ref = paged_attention_ref(**batch, window=20)
    qpos = int(batch["q_pos"][0])
    ends = batch["block_pos"][0] + batch["block_len"][0] - 1
    out_of_window = (batch["block_len"][0] > 0) & (ends <= qpos - 20)
    assert out_of_window.sum() >= 5
    k, v = batch["k_cache"].clone(), batch["v_cache"].clone()
    for page in batch["block_table"][0][out_of_window].tolist():
        k[page], v[page] = float("nan"), float("nan")
    for splits, cfg, loop in ((None, (0, 16, 4, 1), None), (3, (16, 16, 4, 1), "flat_runs"),
                              (1, (16, 16, 4, 1), "per_tile")):
        opts = KernelOptions(num_splits=splits, config=cfg, loop=loop)
        got = ta.paged_attention_triton(**dict(batch, k_cache=k, v_cache=v), max_seqlen_q=1, window=20, options=opts)
        torch.testing.assert_close(got, ref, **_tol(torch.float32))


def test_window_arguments():
    """A window must be a positive int; the Gluon prefill has none, so forcing it with a
    window is refused."""
    batch = _make_batch([([(0, 20, 0)], 4)], page_size=16, hkv=1, group=2, d=32, dtype=torch.float32, seed=3)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            ta.paged_attention_triton(**batch, window=bad)
    with pytest.raises(ValueError, match="sliding window"):
        ta.paged_attention_triton(**batch, window=8, options=KernelOptions(prefill_kernel="gluon"))


# ----------------------------------------------------------------------------------------
# decode (split-K / flash-decoding)
# ----------------------------------------------------------------------------------------


DECODE_CASES = PREFILL_CASES + [
    (4, 64, 32, torch.float16, 64, None),  # a page larger than the key tile: one delta per tile
    (2, 128, None, torch.float32, 16, (0, 16, 4, 1)),  # key tile == page: one delta per tile
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=_case_id)
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_decode_split_k(case, splits):
    """One query per sequence (the decode kernel: query rotated per page, partial
    softmaxes per page slot merged by log-sum-exp), split-K over the key range."""
    g, d, rd, dtype, ps, cfg = case
    gen = random.Random(17)
    seqs = []
    for nc in (5, 0, 2, 8):
        chunks, pos = _chunks(gen, nc, 0, lo=5, hi=50)
        seqs.append((chunks + [(pos, gen.randint(1, 40), 0)], 1))
    seqs.insert(2, ([(0, 5, 0)], 0))  # a sequence not decoding this step
    batch = _make_batch(seqs, page_size=ps, hkv=2, group=g, d=d, rotary_dim=rd, dtype=dtype, seed=8)
    _check_attention(batch, max_seqlen_q=1, num_splits=splits, config=cfg)


def test_decode_auto_splits_are_used(monkeypatch):
    """On one long sequence the default split count is > 1, so the merge kernel runs."""
    gen = random.Random(18)
    chunks, pos = _chunks(gen, 12, 0, lo=40, hi=60)
    batch = _make_batch([(chunks + [(pos, 9, 0)], 1)], page_size=16, hkv=1, group=4, d=64,
                        dtype=torch.float16, seed=9)
    calls = []
    monkeypatch.setattr(ta.launcher, "_merge_splits", _LaunchSpy(ta.launcher._merge_splits, calls))
    _check_attention(batch, max_seqlen_q=1)
    assert calls, "expected a split-K launch"


@pytest.mark.parametrize("batch_n", [2, 8, 16])
def test_decode_split_count(batch_n, monkeypatch):
    """Decode in the run loop (pages of 64, head_dim 128) runs the configuration of
    ``configs.DECODE_CFG_RUNS`` and splits the keys until about
    ``DECODE_RUNS_PROGRAMS_PER_SM`` programs an SM (8 SMs under the interpreter), the split
    count rounded down to a power of two and at most half the key tiles: 2 sequences x 2 KV
    heads -> 8; 16 programs -> 2; 32 -> 1."""
    from lazyllm.kernels.triton import configs

    calls = []
    monkeypatch.setattr(ta.launcher, "_paged_attn_fwd", _LaunchSpy(ta.launcher._paged_attn_fwd, calls))
    seqs = _short_seqs(random.Random(70 + batch_n), batch_n, 8, 1, 4)
    batch = _make_batch(seqs, page_size=64, hkv=2, group=4, d=128, dtype=torch.float16, seed=71)
    kv_tiles = batch["block_table"].shape[1]  # one 64-key tile a page (padding entries included)
    assert kv_tiles // 2 >= 4
    want_splits = min({2: 8, 8: 2, 16: 1}[batch_n], kv_tiles // 2)
    _check_attention(batch, max_seqlen_q=1)
    assert calls, "the general kernel did not run"
    assert calls[-1]["grid"][1] == 2 * want_splits
    block_n, warps, _ = configs.DECODE_CFG_RUNS[128]
    assert (calls[-1]["BLOCK_N"], calls[-1]["num_warps"]) == (block_n, warps)


# ----------------------------------------------------------------------------------------
# rerotate copy and KV write
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d,rd,ps,hkv", [(64, 64, 16, 2), (128, 64, 32, 3), (64, 48, 16, 1)])
def test_rerotate_copy(dtype, d, rd, ps, hkv):
    torch.manual_seed(0)
    n_layers, n_pages, n = 2, 12, 5
    k = torch.randn(n_layers, n_pages, ps, hkv, d).to(dtype)
    v = torch.randn_like(k)
    perm = torch.randperm(n_pages)
    src, dst = perm[:n].to(torch.int32), perm[n:2 * n].to(torch.int64)
    delta = torch.randint(-3000, 30000, (n,), dtype=torch.int32)
    inv_freq = _inv_freq(rd)
    k_ref, v_ref = k.clone(), v.clone()
    rerotate_copy_ref(k_ref, v_ref, src, dst, delta, inv_freq)
    ta.rerotate_copy_triton(k, v, src, dst, delta, inv_freq, block_rows=16)
    torch.testing.assert_close(k, k_ref, **_tol(dtype))
    assert torch.equal(v, v_ref)
    assert not torch.equal(k[:, dst.long()], k[:, src.long()])  # it did rotate


def test_write_kv():
    torch.manual_seed(0)
    kc = torch.randn(6, 16, 3, 64, dtype=torch.float16)
    vc = torch.randn_like(kc)
    slots = torch.randperm(6 * 16)[:20]
    k = torch.randn(20, 3, 64, dtype=torch.float16)
    v = torch.randn_like(k)
    kr, vr = kc.clone(), vc.clone()
    write_kv_ref(kr, vr, slots, k, v)
    ta.write_kv_triton(kc, vc, slots, k, v)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    before = kc.clone()
    ta.write_kv_triton(kc, vc, torch.tensor([-1, -1]), k[:2], v[:2])  # padding slots: no write
    assert torch.equal(kc, before)


def _relerr(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------------------
# batch-invariant launches
# ----------------------------------------------------------------------------------------


def _invariant_batches(dtype, device="cpu", d=64, page_size=64, seed=31):
    """A prefill batch of three sequences over cached chunks, and the same tables decoding
    one query each: the query at each sequence's last position, ``q`` shared."""
    gen = random.Random(seed)
    seqs = []
    for nc, nq in ((4, 7), (1, 1), (6, 12)):
        chunks, pos = _chunks(gen, nc, 0, lo=20, hi=90)
        seqs.append((chunks + [(pos, nq + 3, 0)], nq))
    b = _make_batch(seqs, page_size=page_size, hkv=2, group=4, d=d, dtype=dtype, seed=seed, pad_extra=0)
    cu = b["cu_seqlens_q"]
    last = cu[1:] - 1
    dec = dict(b, q=b["q"][last].contiguous(), q_pos=b["q_pos"][last],
               cu_seqlens_q=torch.arange(len(seqs) + 1, dtype=torch.int32))
    b = {k: v.to(device) if torch.is_tensor(v) else v for k, v in b.items()}
    dec = {k: v.to(device) if torch.is_tensor(v) else v for k, v in dec.items()}
    return b, dec, last.to(device)


@pytest.mark.parametrize("page_size", [16, 64])
def test_batch_invariant_launch_matches_reference(page_size):
    """``batch_invariant=True`` (one launch configuration, no split-K) computes the same
    function: prefill and decode against the reference, pages smaller and larger than the
    fixed key tile."""
    b, dec, _ = _invariant_batches(torch.float32, page_size=page_size)
    _check_attention(b, max_seqlen_q=12, batch_invariant=True)
    _check_attention(dec, max_seqlen_q=1, batch_invariant=True)
