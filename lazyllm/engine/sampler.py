"""Token sampling and incremental detokenization with stop strings."""
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


class Detokenizer:
    """Turns generated ids into text deltas in O(1) work per token (it re-decodes only a
    short window, as vLLM does), holding back text that might still become a stop string
    or an incomplete UTF-8 character."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tok = tokenizer
        self.stop = stop
        self.max_stop = max((len(x) for x in stop), default=0)
        self.ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self._prefix = 0  # window start: tokens before it are already in self.text
        self._read = 0  # tokens whose text is settled

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int, final: bool = False) -> str:
        self.ids.append(token_id)
        if self.stopped:
            return ""
        prefix_text = self._decode(self.ids[self._prefix:self._read])
        new_text = self._decode(self.ids[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            start = len(self.text)
            self.text += new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
            if self.stop:
                # only the tail can hold a new stop string
                lo = max(0, start - self.max_stop)
                for x in self.stop:
                    i = self.text.find(x, lo)
                    if i >= 0:
                        self.text = self.text[:i]
                        self.stopped = True
                        lo = min(lo, i)
        return self._flush(final or self.stopped)

    def finish(self) -> str:
        return self._flush(True)

    def _flush(self, final: bool) -> str:
        safe = len(self.text)
        if not final:
            for x in self.stop:
                for k in range(min(len(x) - 1, safe), 0, -1):
                    if self.text[:safe].endswith(x[:k]):
                        safe -= k
                        break
        safe = max(safe, self.emitted)
        delta = self.text[self.emitted:safe]
        self.emitted = safe
        return delta
