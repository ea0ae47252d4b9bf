"""The model identity (``lazyllm.model.identity``): ``model_id`` names a checkpoint whatever
its dtype, stays what it was (the shipped packet files record it), and ``fingerprint`` adds
the dtype."""
import pytest
import torch

from lazyllm.model.identity import fingerprint, model_id
from lazyllm.model.llama import LlamaFamilyModel
from lazyllm.model.packets import SHIPPED_DIR, load_packets, shipped_packets
from tests.conftest import make_tiny

# model_id of ``_fixed("llama")`` and ``_fixed("gemma3")`` as packet files have recorded it: a change here
# orphans every packet file trained so far
FIXED_IDS = {"llama": "84f9e3941232acd2bb83962040ffdc18", "gemma3": "4e1f1f2ffd385b33563146044f4d4c7a"}


def _fixed(family: str, dtype=torch.float32) -> LlamaFamilyModel:
    """A tiny model whose weights are exact small fractions (no random generator involved),
    in ``dtype`` (its RoPE buffers stay float32, as a checkpoint loaded in ``dtype`` has them)."""
    hf = make_tiny(family, num_hidden_layers=2 if family == "llama" else 3, vocab_size=512)
    with torch.no_grad():
        for i, p in enumerate(hf.parameters()):
            p.copy_(((torch.arange(p.numel()) * (i + 3)) % 17 - 8).reshape(p.shape) / 16)
            p.data = p.data.to(dtype)
    return LlamaFamilyModel(hf, fuse=False, fused_kernels=False)


@pytest.mark.parametrize("family", sorted(FIXED_IDS))
def test_model_id_is_stable(family):
    assert model_id(_fixed(family)) == FIXED_IDS[family]


def test_model_id_ignores_the_dtype_and_the_fingerprint_does_not():
    a, b = _fixed("llama"), _fixed("llama", torch.bfloat16)
    assert model_id(a) == model_id(b)
    assert fingerprint(a) != fingerprint(b)
    assert fingerprint(a) == fingerprint(a, torch.float32) != fingerprint(a, torch.float16)
    assert fingerprint(a).startswith(model_id(a))


def test_other_weights_or_windows_give_another_id():
    a = _fixed("gemma3")
    other = make_tiny("gemma3", seed=5, vocab_size=512)
    assert model_id(LlamaFamilyModel(other, fuse=False, fused_kernels=False)) != model_id(a)
    windowed = make_tiny("gemma3", window=8, vocab_size=512)
    windowed.load_state_dict(other.state_dict())
    assert model_id(LlamaFamilyModel(windowed, fuse=False, fused_kernels=False)) != \
        model_id(LlamaFamilyModel(other, fuse=False, fused_kernels=False))


@pytest.mark.slow
def test_shipped_packets_still_belong_to_the_default_model(default_llm_parts):
    """Every shipped packet records the default model's id, and loads for it."""
    model, _ = default_llm_parts
    m = LlamaFamilyModel(model, fuse=False, fused_kernels=False)
    files = sorted(SHIPPED_DIR.glob("*.safetensors"))
    assert files
    mine = model_id(m)
    assert all(load_packets(f).model == mine for f in files)
    p = shipped_packets(m, "isolated")
    assert p is not None and p.info.get("default")
