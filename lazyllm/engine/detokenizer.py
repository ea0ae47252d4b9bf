"""Incremental detokenization with stop strings."""
from __future__ import annotations


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
