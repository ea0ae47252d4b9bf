"""The attention backend's step plan: the one place that names each layer kind's kernel
(reference, paged, grouped shared-chunk decode), and the launcher's key-tile loops by name."""
import pytest
import torch

from lazyllm.kernels.options import LOOPS, KernelOptions, KeyLoop
from lazyllm.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    Kernel,
    SharedMeta,
    StepPlan,
    TorchAttention,
    make_backend,
)


def _meta(shared=False, ctx=False):
    z = torch.zeros((2, 3), dtype=torch.int32)
    return AttentionMetadata(
        positions=torch.tensor([5, 9], dtype=torch.int32), cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
        slot_mapping=torch.tensor([5, 9]), block_table=z, block_pos=z, block_delta=z, block_len=z, max_seqlen_q=1,
        shared=SharedMeta(plan=None, members_per_item=16, part_o=torch.zeros(1), part_lse=torch.zeros(1))
        if shared else None,
        ctx_range=torch.tensor([[0, 3], [0, 4]], dtype=torch.int32) if ctx else None)


INV = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)


@pytest.fixture(scope="module")
def triton_backend():
    pytest.importorskip("triton")
    return make_backend("triton", torch.device("cpu"))


def test_torch_backend_runs_the_reference_everywhere():
    b = make_backend("auto", torch.device("cpu"))
    assert isinstance(b, TorchAttention)
    p = b.plan(_meta(shared=True), INV)
    assert (p.full, p.windowed, p.ctx, p.launch) == (Kernel.REFERENCE, Kernel.REFERENCE, {}, {})
    assert not b.shared_decode(64, 16)


def test_calibration_arguments_only_where_the_step_has_document_ranges():
    b = make_backend("torch", torch.device("cpu"), calibration=(0.5, 2.0))
    assert b.plan(_meta(), INV).ctx == {}
    ctx = b.plan(_meta(ctx=True), INV).ctx
    assert (ctx["ctx_temperature"], ctx["ctx_lse_scale"]) == (0.5, 2.0) and ctx["ctx_range"].shape == (2, 2)


def test_triton_plan_picks_grouped_decode_only_for_full_layers_of_sharing_steps(triton_backend):
    b = triton_backend
    p = b.plan(_meta(), INV)
    assert (p.full, p.windowed) == (Kernel.PAGED, Kernel.PAGED)
    assert p.launch["max_seqlen_q"] == 1 and "rope" in p.launch
    p = b.plan(_meta(shared=True), INV)
    assert (p.full, p.windowed) == (Kernel.GROUPED, Kernel.PAGED)
    assert p.kernel(None) is Kernel.GROUPED and p.kernel(32) is Kernel.PAGED


def test_calibrated_steps_never_take_the_grouped_kernel():
    pytest.importorskip("triton")
    b = make_backend("triton", torch.device("cpu"), calibration=(0.7, 1.0))
    p = b.plan(_meta(shared=True, ctx=True), INV)
    assert p.full is Kernel.PAGED and p.ctx
    assert not b.shared_decode(64, 16)


@pytest.mark.parametrize("d,ps,kw,want", [
    (64, 16, {}, True), (128, 64, {}, True), (256, 64, {}, False), (64, 8, {}, False), (8, 16, {}, False),
    (64, 16, dict(batch_invariant=True), False), (64, 16, dict(options=KernelOptions(shared_decode=False)), False),
])
def test_shared_decode_applies_where_the_grouped_kernel_does(d, ps, kw, want):
    pytest.importorskip("triton")
    assert make_backend("triton", torch.device("cpu"), **kw).shared_decode(d, ps) is want


def test_a_backend_without_its_own_kernels_runs_only_what_the_reference_serves():
    class Bare(AttentionBackend):
        name = "bare"

    b = Bare()
    p = b.plan(_meta(shared=True), INV)
    assert (p.full, p.windowed) == (Kernel.GROUPED, Kernel.PAGED)
    # the reference path needs nothing of the backend; its own kernel it must launch itself
    q = torch.randn(2, 2, 16)
    k = v = torch.randn(4, 16, 1, 16)
    assert b.run(q, _meta(), k, v, INV, 0.25, StepPlan(Kernel.REFERENCE, Kernel.REFERENCE)).shape == q.shape
    with pytest.raises(NotImplementedError, match="paged"):
        b.run(q, _meta(), k, v, INV, 0.25, StepPlan(Kernel.PAGED, Kernel.REFERENCE))


def test_key_loops_are_named():
    assert [int(LOOPS[n]) for n in ("per_tile", "per_run", "flat_runs", "halves")] == [0, 1, 2, 3]
    assert all(isinstance(v, KeyLoop) for v in LOOPS.values())
    assert [loop.rotates_query for loop in KeyLoop] == [False, True, True, True]
