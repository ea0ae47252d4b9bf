"""Token sampling: greedy, temperature, top-k and top-p."""
from __future__ import annotations

import torch

from ..types import SamplingParams


def sample_token(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """Pick the next token from float32 ``logits`` of shape ``(vocab,)``."""
    if p.greedy:
        return int(torch.argmax(logits).item())
    x = logits.float() / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        cum = torch.cumsum(probs, dim=-1)
        drop = cum - probs > p.top_p  # keep the smallest set whose mass reaches top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
