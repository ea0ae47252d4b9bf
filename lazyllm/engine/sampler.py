"""Token sampling: greedy, temperature, top-k and top-p."""
from __future__ import annotations

from typing import Protocol

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


class TokenConstraint(Protocol):
    """A request's grammar: which tokens may come next (one bitmask row), and its progress."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row ``row`` of an int32 ``(B, ceil(V / 32))`` CPU tensor: bit ``j`` of word
        ``i`` set allows token ``32 * i + j``."""

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar rejects it."""

    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more: the request must stop."""


def constrain_logits(logits: torch.Tensor, constraint: TokenConstraint) -> torch.Tensor:
    """``logits`` ``(vocab,)`` with every token the constraint forbids at -inf (a copy)."""
    V = logits.shape[-1]
    words = torch.zeros((1, (V + 31) // 32), dtype=torch.int32)
    constraint.fill_bitmask(words, 0)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((words[0, :, None] >> shifts) & 1).bool().flatten()[:V]
    return logits.float().masked_fill(~allowed.to(logits.device), float("-inf"))
