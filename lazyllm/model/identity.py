"""Identity of a model: one hash over its architecture, RoPE and a sample of its weights.

``model_id`` names the checkpoint whatever dtype or device it was loaded in (the weight
sample is rounded to bfloat16): packet files record it to say which model they were trained
for. ``fingerprint`` adds the dtype: cache keys and the disk tier use it, since KV computed in
one dtype is not the KV of another.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

# how many leading elements of each sampled weight tensor go into the hash
SAMPLE = 65536


def model_id(model) -> str:
    """Identity of ``model`` (a ``LlamaFamilyModel``) for packets: its spec, RoPE (frequencies,
    scales, windows, each layer's frequency) and the first ``SAMPLE`` elements of six weight
    tensors rounded to bfloat16, so the same checkpoint loaded in float32 on a CPU or in
    bfloat16 on a GPU has one id while another checkpoint has another. A 32-digit hex
    string."""
    h = hashlib.blake2b(digest_size=16)
    spec = dataclasses.asdict(model.spec)
    # the global layers' RoPE scale: kept in the payload so that ids stay what they were
    spec["rope_scale"] = model.rope_scales[model.global_freq]
    h.update(json.dumps(spec, sort_keys=True).encode())
    for f in model.inv_freqs:
        h.update(f.detach().cpu().numpy().tobytes())
    h.update(json.dumps([model.windows, model.freq_index, model.rope_scales]).encode())
    with torch.no_grad():
        layer0, last = model.layers[0], model.layers[-1]
        for t in (model.embed, model.lm_head, layer0["wk"], layer0["wq"], last["wd"], model.final_norm):
            sample = t.detach().flatten()[:SAMPLE].to("cpu", torch.bfloat16).float().contiguous()
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def fingerprint(model, dtype: torch.dtype | None = None) -> str:
    """Identity of ``model`` for cache keys: ``model_id`` and the dtype its KV is computed in
    (``dtype``; ``None``: ``model.dtype``), so two checkpoints never share KV, nor one
    checkpoint in two dtypes, while the same weights loaded from a GGUF file or a converted
    folder do."""
    dtype = model.dtype if dtype is None else dtype
    return f"{model_id(model)}:{str(dtype).removeprefix('torch.')}"


__all__ = ["model_id", "fingerprint", "SAMPLE"]
