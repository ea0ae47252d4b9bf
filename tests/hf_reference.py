"""Ground truth for the engine tests: the transformers model itself, fed the request's
logical token sequence with the 4-D attention mask and position ids that docs/design.md
defines ("What a request means")."""
from __future__ import annotations

import torch


def semantic_mask(segments, reuse: str, chunk_context: str) -> torch.Tensor:
    """Boolean ``(n, n)`` mask (True = may attend) of a request's prompt."""
    kinds, seg_of = [], []
    for si, (kind, ids) in enumerate(segments):
        kinds += [kind] * len(ids)
        seg_of += [si] * len(ids)
    n = len(kinds)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    if reuse in ("none", "prefix"):
        return causal
    seg = torch.tensor(seg_of)
    is_prefix = torch.tensor([k == "prefix" for k in kinds])
    is_chunk = torch.tensor([k == "chunk" for k in kinds])
    same = seg[:, None] == seg[None, :]
    chunk_rows = same | (is_prefix[None, :] if chunk_context == "prefix" else torch.zeros(1, n, dtype=torch.bool))
    allowed = torch.where(is_chunk[:, None], chunk_rows, torch.ones(n, n, dtype=torch.bool))
    return causal & allowed


def _layer_masks(model, mask: torch.Tensor, pos: torch.Tensor, window: int | None, dev):
    """The 4-D attention mask, or with a sliding ``window`` one per layer type (Gemma 3): the
    local layers' mask also drops keys ``window`` or more positions back."""
    if window is None:
        return mask[None, None].to(dev)
    near = (pos[:, None] - pos[None, :]) < window
    return {"full_attention": mask[None, None].to(dev), "sliding_attention": (mask & near)[None, None].to(dev)}


@torch.inference_mode()
def hf_greedy(model, segments, reuse: str, chunk_context: str, max_new_tokens: int, eos_ids=(),
              window: int | None = None) -> list[int]:
    """Greedy tokens of the transformers model under the request's semantics (no KV cache:
    every step recomputes the whole sequence with the extended mask). ``window``: the
    model's sliding window, applied to its local layers (``config.layer_types``)."""
    ids = [t for _, s in segments for t in s]
    mask = semantic_mask(segments, reuse, chunk_context)
    out: list[int] = []
    dev = next(model.parameters()).device
    for _ in range(max_new_tokens):
        n = len(ids)
        logits = model(
            input_ids=torch.tensor([ids], device=dev),
            attention_mask=_layer_masks(model, mask, torch.arange(n), window, dev),
            position_ids=torch.arange(n, device=dev)[None],
        ).logits[0, -1]
        tok = int(torch.argmax(logits.float()))
        out.append(tok)
        if tok in eos_ids:
            break
        ids.append(tok)
        grown = torch.ones(n + 1, n + 1, dtype=torch.bool)
        grown[:n, :n] = mask
        grown[:n, n] = False
        mask = grown
    return out


@torch.inference_mode()
def hf_generate(model, ids: list[int], max_new_tokens: int, eos_ids) -> list[int]:
    """transformers' own ``generate`` (greedy, full attention)."""
    dev = next(model.parameters()).device
    out = model.generate(
        torch.tensor([ids], device=dev), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids), pad_token_id=list(eos_ids)[0],
    )[0, len(ids):].tolist()
    return out


@torch.inference_mode()
def hf_greedy_prefix_context(model, segments, max_new_tokens: int, eos_ids=(), window: int | None = None) -> list[int]:
    """Ground truth for ``chunk_context="prefix"``: each chunk is encoded as if it directly
    followed the shared prefix (positions ``P..P+L-1``, attending to the prefix and itself),
    which is what makes its KV reusable at any offset; its keys are then placed at their
    logical positions ``P + S_d + i`` by a pure RoPE rotation of ``S_d``, and the suffix and
    generated tokens attend to everything. Pass 1 is one transformers forward with a 4-D
    mask and explicit (repeating) position ids; pass 2 decodes with transformers over that
    cache."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import rotate_half

    dev = next(model.parameters()).device
    kinds = [k for k, _ in segments]
    assert kinds[0] == "prefix" and kinds[-1] == "suffix"
    P = len(segments[0][1])
    head_ids = [t for _, s in segments[:-1] for t in s]
    pos, seg_of = list(range(P)), [0] * P
    for si, (_, s) in enumerate(segments[1:-1], start=1):
        pos += range(P, P + len(s))
        seg_of += [si] * len(s)
    n = len(head_ids)
    seg = torch.tensor(seg_of)
    idx = torch.arange(n)
    mask = (idx[None, :] <= idx[:, None]) & ((seg[:, None] == seg[None, :]) | (seg[None, :] == 0))
    # with a window: masks by position for pass 1, and a cache that keeps every key (the
    # sliding layers' own cache would drop the keys that pass 2 re-rotates)
    cache = DynamicCache(config=model.config) if window is None else DynamicCache()
    model(input_ids=torch.tensor([head_ids], device=dev),
          attention_mask=_layer_masks(model, mask, torch.tensor(pos), window, dev),
          position_ids=torch.tensor([pos], device=dev), past_key_values=cache, use_cache=True)
    # place chunk d's keys at logical offset S_d (they were computed at P + i)
    shift = torch.zeros(n, dtype=torch.long)
    off = 0
    for si, (_, s) in enumerate(segments[1:-1], start=1):
        shift[seg == si] = off
        off += len(s)
    rot = model.model.rotary_emb
    types = getattr(model.config, "layer_types", None)
    for li, layer in enumerate(cache.layers):
        k = layer.keys  # (1, heads, n, head_dim)
        if types and hasattr(rot, f"{types[li]}_inv_freq"):  # per-layer-type RoPE (Gemma 3)
            cos, sin = rot(k, shift[None].to(dev), types[li])
            scale = float(getattr(rot, f"{types[li]}_attention_scaling", 1.0))
        else:
            cos, sin = rot(k, shift[None].to(dev))
            scale = float(getattr(rot, "attention_scaling", 1.0))
        cos, sin = (cos / scale)[:, None].to(k.dtype), (sin / scale)[:, None].to(k.dtype)
        layer.keys.copy_(k * cos + rotate_half(k) * sin)
    ids = list(segments[-1][1])
    start = n
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=torch.tensor([ids], device=dev),
                       position_ids=torch.arange(start, start + len(ids), device=dev)[None],
                       past_key_values=cache, use_cache=True).logits[0, -1]
        tok = int(torch.argmax(logits.float()))
        out.append(tok)
        if tok in eos_ids:
            break
        start += len(ids)
        ids = [tok]
    return out


def reference_tokens(model, segments, reuse, chunk_context, max_new_tokens, eos_ids, window=None):
    """Greedy ground truth for any reuse mode and chunk context (``window``: the model's
    sliding window, for its local layers)."""
    if reuse in ("lazy", "block") and chunk_context == "prefix":
        return hf_greedy_prefix_context(model, segments, max_new_tokens, eos_ids, window)
    return hf_greedy(model, segments, reuse, chunk_context, max_new_tokens, eos_ids, window)
