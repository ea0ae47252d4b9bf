"""Fused projections (``LlamaFamilyModel(fuse=True)``): one tensor per layer for q/k/v and for
gate/up, the transformers parameters views of it."""
import torch

from lazyllm.model.llama import LlamaFamilyModel
from tests.conftest import make_tiny


def test_a_second_model_over_the_same_weights_shares_their_fused_projections():
    """Fusing q/k/v and gate/up re-points the transformers parameters at views of one
    tensor; a second engine over the same model must find them fused and use that storage,
    not hold a second copy of every layer's projections (about 9 GB at Llama-3.1-8B's shapes)."""
    hf = make_tiny("llama", seed=5)
    a = LlamaFamilyModel(hf, fuse=True, fused_kernels=False)
    b = LlamaFamilyModel(hf, fuse=True, fused_kernels=False)
    for wa, wb, layer in zip(a.layers, b.layers, hf.model.layers):
        for fused, part in (("wqkv", layer.self_attn.q_proj), ("wgu", layer.mlp.gate_proj)):
            assert wb[fused].data_ptr() == wa[fused].data_ptr() == part.weight.data_ptr(), fused
            assert wb[fused].shape == wa[fused].shape
        torch.testing.assert_close(wb["wqkv"][-layer.self_attn.v_proj.weight.shape[0]:], layer.self_attn.v_proj.weight)
    # and a part that is not where the fused tensor expects it is copied again, not shared
    layer = hf.model.layers[0]
    layer.mlp.up_proj.weight.data = layer.mlp.up_proj.weight.data.clone()
    c = LlamaFamilyModel(hf, fuse=True, fused_kernels=False)
    assert c.layers[0]["wgu"].data_ptr() != a.layers[0]["wgu"].data_ptr()
    assert c.layers[1]["wgu"].data_ptr() == a.layers[1]["wgu"].data_ptr()
    torch.testing.assert_close(c.layers[0]["wgu"], a.layers[0]["wgu"])
