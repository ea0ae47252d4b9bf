"""The attention-mass kernel (``paged_attention_mass_triton``) against its torch twin
``paged_attention_mass_ref``, and attention-guided recompute on the Triton backend.

On CPU the kernel runs in Triton's interpreter, from a private copy of the kernel package
(``tests/_triton_load.py``). Every page slot that no table entry covers (padding entries,
slots past ``block_len``, unused pages) holds NaN, so a read of one shows in the result.
"""
from __future__ import annotations

import random

import pytest
import torch

from lazyllm.kernels.reference import paged_attention_mass_ref
from tests._triton_load import load_kernel_module
from tests.conftest import PAD_ENTRY, paged_batch

triton = pytest.importorskip("triton", reason="triton is not installed")

ta = load_kernel_module("triton", interpret=True)


def _batch(seqs, *, page_size, hkv, group, d, rotary_dim=None, dtype=torch.float32, seed=0):
    """``paged_batch`` with one or two padding entries per table, in random places."""
    def place(gen, entries):
        for _ in range(gen.randint(1, 2)):
            entries.insert(gen.randint(0, len(entries)), PAD_ENTRY)

    return paged_batch(seqs, page_size=page_size, hkv=hkv, group=group, d=d, rotary_dim=rotary_dim, dtype=dtype,
                       seed=seed, spare_pages=4, place_padding=place)


def _seqs(gen):
    """Cached chunks at nonzero deltas then the sequence's own tokens (queries the last of
    them), a plain causal prefill, a sequence without queries, a decode step, and one with
    queries but no key at all (its table is padding only)."""
    segs, pos = [], 0
    for _ in range(3):
        n = gen.randint(5, 40)
        segs.append((pos, n, pos if pos else gen.randint(1, 5000)))
        pos += n
    nq = gen.randint(8, 20)
    own = gen.randint(3, 20)
    return [
        (segs + [(pos, own + nq, 0)], nq),
        ([(0, gen.randint(20, 50), 0)], gen.randint(20, 30)),
        ([(0, 9, 0)], 0),
        ([(0, 30, 0), (30, gen.randint(1, 40), 0)], 1),
        ([], 3),
    ]


# (group, head_dim, rotary_dim, dtype, page_size, window)
CASES = [
    (1, 32, None, torch.float32, 16, None),
    (4, 32, None, torch.float16, 16, None),
    (2, 64, None, torch.float32, 32, None),
    (3, 32, 16, torch.float16, 32, None),  # partial rotary
    (2, 16, None, torch.float32, 16, 7),  # the tiny test models' head_dim, a sliding window
    (4, 32, None, torch.float16, 32, 20),
    (2, 24, 8, torch.float32, 16, None),  # a head_dim that is not a power of two
    (2, 32, None, torch.float16, 64, 40),  # a key tile inside one page
]


def _case_id(c):
    g, d, rd, dt, ps, w = c
    return f"g{g}-d{d}-rd{rd or d}-{str(dt)[6:]}-ps{ps}-w{w}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_mass_kernel_matches_reference(case):
    g, d, rd, dtype, ps, window = case
    batch = _batch(_seqs(random.Random(_case_id(case))), page_size=ps, hkv=2, group=g, d=d,
                   rotary_dim=rd, dtype=dtype, seed=g * 7 + ps)
    ref = paged_attention_mass_ref(**batch, window=window)
    split = ta.paged_attention_mass_triton(**batch, window=window, num_splits=3)  # pass 1's key range split
    torch.testing.assert_close(split, ref, atol=2e-5, rtol=2e-5)
    got = ta.paged_attention_mass_triton(**batch, window=window)
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    # padding entries and slots past each entry's length get nothing
    slot = torch.arange(ps)[None, None, :]
    assert (got[slot >= batch["block_len"][..., None]] == 0).all()
    # every query row that sees a key spreads a mass of 1
    hq = batch["q"].shape[1]
    assert got[0].sum().item() == pytest.approx(hq * int(batch["cu_seqlens_q"][1]), rel=1e-5)
    assert got[2].abs().sum() == 0 and got[4].abs().sum() == 0  # no queries; no keys


def test_mass_kernel_options():
    """The step's shared rope table, ``max_seqlen_q`` given, no RoPE at all, no queries."""
    batch = _batch(_seqs(random.Random(5)), page_size=16, hkv=2, group=2, d=32, seed=5)
    ref = paged_attention_mass_ref(**batch)
    rope = ta.rope_table(batch["block_delta"], batch["inv_freq"])
    nq = batch["cu_seqlens_q"].diff()
    got = ta.paged_attention_mass_triton(**batch, rope=rope, max_seqlen_q=int(nq.max()))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    no_rope = dict(batch, inv_freq=torch.zeros(0))
    torch.testing.assert_close(ta.paged_attention_mass_triton(**no_rope), paged_attention_mass_ref(**no_rope),
                               atol=2e-5, rtol=2e-5)
    empty = dict(batch, q=batch["q"][:0], q_pos=batch["q_pos"][:0],
                 cu_seqlens_q=torch.zeros_like(batch["cu_seqlens_q"]))
    assert ta.paged_attention_mass_triton(**empty).abs().sum() == 0


def test_attention_selected_recompute_is_the_same_on_the_triton_backend(tokenizer):
    """Attention-guided recompute on CPU: the Triton backend (kernels in the interpreter)
    gives the question's attention mass of the torch backend, so the same tokens are
    recomputed and the same answer comes out."""
    from lazyllm import LazyLLM
    from tests.conftest import make_tiny

    if torch.cuda.is_available():
        pytest.skip("the interpreter path is for CPU-only machines")
    model = make_tiny("llama", seed=3)
    docs = [f"Record {i}: " + " ".join(f"item{i}_{j}" for j in range(9 + 5 * i)) for i in range(3)]
    runs = {}
    for backend in ("torch", "triton"):
        llm = LazyLLM(model=model, tokenizer=tokenizer, recompute_ratio=0.2, recompute_selection="attention",
                      chunk_context="prefix", kv_cache_bytes=16 << 20, attention_backend=backend, quality="isolated")
        assert llm.attention_backend == backend
        seen = []
        real = llm.engine.recovery.question_attention
        llm.engine.recovery.question_attention = lambda r, real=real, seen=seen: seen.append(real(r)) or seen[-1]
        llm.warm(docs[::-1])  # cached KV at other positions: nonzero deltas
        out = llm.generate("Which item is first?", chunks=docs, max_new_tokens=2)
        runs[backend] = (seen, out)
        llm.close()
    (m_ref,), out_ref = runs["torch"]
    (m_tri,), out_tri = runs["triton"]
    torch.testing.assert_close(m_tri, m_ref, atol=1e-4, rtol=1e-4)
    n_pick = -(-m_ref.numel() // 5)
    assert set(torch.topk(m_tri, n_pick).indices.tolist()) == set(torch.topk(m_ref, n_pick).indices.tolist())
    assert out_tri.token_ids == out_ref.token_ids
    assert out_tri.usage.cached_chunk_tokens == out_ref.usage.cached_chunk_tokens
