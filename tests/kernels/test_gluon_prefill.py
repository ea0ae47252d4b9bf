"""The warp-specialized Gluon prefill (``lazyllm.kernels.triton.gluon_prefill``) against the reference.

Gluon has no interpreter, so the kernel itself runs only on a Hopper GPU
(``tests/gpu/test_gluon_prefill_compiled.py``); here, on CPU, this checks that the module
imports and refuses what it cannot serve, that ``paged_attention_triton`` keeps CPU calls on
the Triton kernels, and that the kernel compiles for sm_90 (this Triton's ptxas) without
register spills.
"""
from __future__ import annotations

import random

import pytest
import torch

from lazyllm.kernels.options import KernelOptions
from lazyllm.kernels.reference import paged_attention_ref
from tests.kernels.test_kernels_triton import _chunks, _LaunchSpy, _make_batch, _relerr
from tests.kernels.test_kernels_triton import ta as ta_interp

gp = pytest.importorskip("lazyllm.kernels.triton.gluon_prefill",
                         reason="this triton has no Gluon (triton.experimental.gluon)")


def _batch(dtype, seed=70, page_size=64, pad_extra=2):
    """Three sequences: a prefix, chunks at deltas up to ~1e5 positions (two neighbours
    sharing one delta), then the queries' own pages; padding entries in the tables. Every
    slot of the pool finite (large where never written, so a leak would show)."""
    gen = random.Random(seed)
    seqs = []
    for start, nc, nq in ((9, 6, 90), (40000, 4, 300), (97000, 2, 17)):
        chunks, pos = _chunks(gen, nc, start, lo=40, hi=300)
        if len(chunks) > 2:
            chunks[2] = (chunks[2][0], chunks[2][1], chunks[1][2])
        seqs.append(([(0, 9, 0)] + chunks + [(pos, nq + 7, 0)], nq))
    b = _make_batch(seqs, page_size=page_size, hkv=2, group=4, d=128, dtype=dtype, seed=seed + 1, pad_extra=pad_extra)
    b["k_cache"] = torch.nan_to_num(b["k_cache"], nan=300.0)
    b["v_cache"] = torch.nan_to_num(b["v_cache"], nan=300.0)
    return b, max(nq for _, nq in seqs)


def test_refuses_what_it_cannot_serve():
    """Clear errors, before any device work: no padding promise, shapes and dtypes the
    kernel does not cover, tables that do not match, and any device but a Hopper GPU."""
    b, nq = _batch(torch.float16)
    ok = dict(max_seqlen_q=nq, padding_finite=True)
    with pytest.raises(ValueError, match="padding_finite"):
        gp.paged_prefill_gluon(**b, max_seqlen_q=nq, padding_finite=False)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gp.paged_prefill_gluon(**dict(b, k_cache=b["k_cache"].float(), v_cache=b["v_cache"].float()), **ok)
    with pytest.raises(ValueError, match="fully rotary"):
        gp.paged_prefill_gluon(**dict(b, inv_freq=b["inv_freq"][:32]), **ok)
    for bad in ((64, 4, 2), (128, 8, 2), (128, 4, 1), (128, 4, 3, 128), (128, 4, 2, 32)):
        with pytest.raises(ValueError, match="config"):
            gp.paged_prefill_gluon(**b, **ok, config=bad)
    with pytest.raises(ValueError, match="int32 block_table"):
        gp.paged_prefill_gluon(**dict(b, block_table=b["block_table"].long()), **ok)
    with pytest.raises(ValueError, match="block tables of shapes"):
        gp.paged_prefill_gluon(**dict(b, block_len=b["block_len"][:, :-1]), **ok)
    with pytest.raises(ValueError, match="runs table"):
        gp.paged_prefill_gluon(**b, **ok, runs=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen_q"):
        gp.paged_prefill_gluon(**b, max_seqlen_q=0, padding_finite=True)
    with pytest.raises(RuntimeError, match="Hopper"):  # CPU tensors (or a GPU other than sm_90)
        gp.paged_prefill_gluon(**b, **ok)


def test_triton_launcher_on_cpu_ignores_padding_finite_and_checks_prefill_kernel():
    """On CPU (the interpreter) ``padding_finite`` changes nothing: the Triton prefill serves
    the call and matches the reference; an unknown ``prefill_kernel`` is a ValueError."""
    b, nq = _batch(torch.float32)
    b = dict(b, q=b["q"][: 40], cu_seqlens_q=torch.tensor([0, 20, 30, 40], dtype=torch.int32), q_pos=b["q_pos"][:40])
    ref = paged_attention_ref(**b)
    got = ta_interp.paged_attention_triton(**b, max_seqlen_q=20, padding_finite=True)
    assert _relerr(got, ref) < 1e-4
    with pytest.raises(ValueError, match="prefill_kernel"):
        ta_interp.paged_attention_triton(**b, max_seqlen_q=20, options=KernelOptions(prefill_kernel="cuda"))


def test_routing_sends_prefill_only_to_gluon(monkeypatch):
    """The launcher's routing as on a Hopper GPU (its checks stubbed on CPU, no kernel run):
    a prefill with the rotary-halves loop and one key split goes to the Gluon kernel; decode
    and a few queries per sequence never do, even on the rotary-halves short path
    (``KernelOptions(short_halves="auto")``) with one key split (the Gluon kernel's 128-row
    tiles would hold 4 of them, which made the engine's decode step slower)."""
    gluon, triton_calls = [], []
    fake = type("FakeGluon", (), {"paged_prefill_gluon": staticmethod(
        lambda *a, **k: gluon.append(k.get("max_seqlen_q")) or k.get("out", a[10] if len(a) > 10 else None))})
    for name, value in (("_interpreting", lambda: False), ("_gluon_supported", lambda *a: True),
                        ("_gluon_module", lambda: fake), ("_GLUON_MIN_KEYS", 0),
                        ("_num_sms", lambda device: 2), ("_paged_attn_fwd", _LaunchSpy(None, triton_calls)),
                        ("_paged_decode_fwd", _LaunchSpy(None, triton_calls)),
                        ("_merge_splits", _LaunchSpy(None, triton_calls))):
        monkeypatch.setattr(ta_interp.launcher, name, value)
    opts = KernelOptions(short_halves="auto", num_splits=1)
    b, nq = _batch(torch.float16)
    last = b["cu_seqlens_q"][1:] - 1
    one = dict(b, q=b["q"][last], q_pos=b["q_pos"][last], cu_seqlens_q=torch.arange(4, dtype=torch.int32))
    ta_interp.paged_attention_triton(**one, max_seqlen_q=1, padding_finite=True, options=opts)
    assert not gluon and triton_calls[-1]["QROT"] == 3, "decode went to the Gluon prefill"
    few = dict(b, q=b["q"][:30], q_pos=b["q_pos"][:30], cu_seqlens_q=torch.tensor([0, 15, 17, 30], dtype=torch.int32))
    ta_interp.paged_attention_triton(**few, max_seqlen_q=15, padding_finite=True, options=opts)
    assert not gluon and triton_calls[-1]["QROT"] == 3, "a short prefill went to the Gluon prefill"
    ta_interp.paged_attention_triton(**b, max_seqlen_q=nq, padding_finite=True, options=opts)
    assert gluon == [nq], "the control: a long prefill should have gone to the Gluon prefill"


# -- compiled for sm_90 on any host: ptxas's registers, spills and shared memory --------------

class _Sm90Driver:
    """Triton's active-driver interface, as far as compiling needs it, for an H100/H200
    target; nothing is launched."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _compile_sm90(monkeypatch, page_size=64, dtype=torch.bfloat16, **kw):
    """The Gluon prefill compiled (not launched) for sm_90 by this Triton's own ptxas, for the
    shapes of Llama-3-8B (8 KV heads of 32 q heads, head_dim 128); returns the compiled kernel."""
    from collections import defaultdict

    from triton.runtime import driver

    kern = gp._paged_prefill_ws
    compiled = []
    real_run = kern.run

    def run(*a, grid, warmup, **k):
        compiled.append(real_run(*a, grid=grid, warmup=True, **k))
        return compiled[-1]

    monkeypatch.setattr(kern, "run", run)
    monkeypatch.setattr(gp, "_on_hopper", lambda t: True)
    nq, kv, hkv, hq, d = 512, 4096, 8, 32, 128
    nb = kv // page_size
    cache = torch.zeros(nb + 2, page_size, hkv, d, dtype=dtype)
    tables = dict(block_table=torch.arange(nb, dtype=torch.int32)[None],
                  block_pos=(torch.arange(nb, dtype=torch.int32) * page_size)[None],
                  block_delta=torch.zeros(1, nb, dtype=torch.int32),
                  block_len=torch.full((1, nb), page_size, dtype=torch.int32))
    prev = driver._active
    driver.set_active(_Sm90Driver())
    try:  # a binder for the sm_90 target, dropped afterwards: nothing kept for real launches
        monkeypatch.setattr(kern, "device_caches", defaultdict(kern.create_binder))
        gp.paged_prefill_gluon(torch.zeros(nq, hq, d, dtype=dtype), torch.arange(kv - nq, kv),
                               torch.tensor([0, nq], dtype=torch.int32), cache, cache.clone(), **tables,
                               inv_freq=torch.rand(d // 2), sm_scale=d ** -0.5, max_seqlen_q=nq,
                               padding_finite=True, **kw)
    finally:
        driver._active = prev
    return compiled[-1]


def _sass(cubin: bytes, tmp_path) -> str:
    import os
    import subprocess

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.fail(f"this Triton has no cuobjdump at {tool}: the sm_90 compile check cannot read its SASS")
    path = tmp_path / "k.cubin"
    path.write_bytes(cubin)
    return subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("page_size,dtype,kw", [
    (64, torch.bfloat16, {}), (64, torch.float16, dict(use_rope=False)),
    (128, torch.bfloat16, dict(config=(128, 4, 3, 64))), (64, torch.bfloat16, dict(config=(128, 4, 2, 64)))])
def test_compiles_for_hopper_without_spills(monkeypatch, tmp_path, page_size, dtype, kw):
    """Gluon has no interpreter, so on a CPU host the kernel is at least compiled for sm_90
    by ptxas: it must compile, keep both consumers' loops in registers (no local-memory
    spill instruction from a consumer's first tensor-core instruction to its last:
    ``setmaxnreg`` gives them their count, the rotator the rest) and fit in an H100/H200's
    227 KiB of shared memory. (ptxas may park a value or two of a partition's prologue in
    local memory; that costs nothing per key.)"""
    import re

    c = _compile_sm90(monkeypatch, page_size=page_size, dtype=dtype, **kw)
    sass = _sass(c.asm["cubin"], tmp_path).splitlines()
    cuts = [i for i, line in enumerate(sass) if "USETMAXREG" in line]
    assert cuts, "no setmaxnreg: the registers were not moved between partitions"
    consumers = 0
    for a, b in zip([0, *cuts], [*cuts, len(sass)]):  # the partitions' code, between register moves
        mma = [i for i in range(a, b) if "HGMMA" in sass[i]]
        if mma:
            consumers += 1
            spills = [line for line in sass[mma[0]:mma[-1]] if re.search(r"\b(?:STL|LDL)\b", line)]
            assert not spills, f"{len(spills)} local-memory spill instructions in a consumer's loop"
    assert consumers == 2, f"{consumers} partitions issue wgmma, expected the two consumers"
    assert c.metadata.shared <= 227 * 1024
