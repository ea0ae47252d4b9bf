"""Turning (system, chunks, question) into token segments with the model's chat template.

The template is rendered once with a marker where the documents go; the text before the
marker is the ``prefix`` segment, each chunk is tokenized alone, and the text after the
marker (question and template tail) is the ``suffix``. The request's logical token
sequence is the concatenation of the segments, by definition: the reference runs in the
tests feed exactly that sequence to transformers.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ..engine.request import Segment
from ..errors import InvalidRequestError
from ..types import Chunk
from .encodings import ChunkEncodings, tokenizer_identity

DOCUMENTS_MARK = "\u2063LAZYLLM_DOCUMENTS\u2063"
DOC_HEADER = "Answer the question using the documents below.\n\nDocuments:\n\n"
QUESTION_HEADER = "Question: "


def check_text(text: str, what: str) -> None:
    if not isinstance(text, str):
        raise InvalidRequestError(f"{what} must be a str, got {type(text).__name__}")
    if not text.strip():
        raise InvalidRequestError(f"{what} is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates
        raise InvalidRequestError(f"{what} is not valid UTF-8: {e}") from None
    if "\x00" in text:
        raise InvalidRequestError(f"{what} contains a NUL character")


# texts of at least this many characters in all are tokenized on several threads
_PARALLEL_CHARS = 8192
_WORKERS = min(8, os.cpu_count() or 1)  # tokenizing threads at most
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="lazyllm-tokenize")
        return _POOL


def _groups(texts: list[str]) -> list[list[str]]:
    """``texts`` in consecutive groups of about equal characters, one per worker (one group
    when they are short or the machine has one core)."""
    total = sum(len(t) for t in texts)
    n = min(len(texts), _WORKERS)
    if n <= 1 or total < _PARALLEL_CHARS:
        return [texts]
    out: list[list[str]] = [[]]
    size = 0
    for t in texts:
        if size >= total * len(out) / n and len(out) < n:
            out.append([])
        out[-1].append(t)
        size += len(t)
    return out


class PromptBuilder:
    """Splits a RAG request into prefix / chunk / suffix token segments."""

    def __init__(self, tokenizer, packet_ids: tuple[list[int], list[int]] | None = None,
                 encodings: ChunkEncodings | None = None):
        self.tok = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        # learned chunk packets (lazyllm.model.packets): virtual ids around every chunk
        self.packet_ids = packet_ids
        # the cache of chunk (and prefix) encodings (None: every segment tokenized anew)
        self.encodings = encodings
        self._identity = (tokenizer_identity(tokenizer), type(self).__name__)
        self._packet_identity = None if packet_ids is None else tuple(map(tuple, packet_ids))

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each of ``texts``: batched tokenizer calls, spread over a few threads
        when there is enough text (a fast tokenizer releases the GIL while it encodes a batch),
        so a request's new chunks are tokenized in parallel."""
        groups = _groups(texts)
        if len(groups) <= 1:
            return self._encode_batch(texts)
        return [ids for part in _pool().map(self._encode_batch, groups) for ids in part]

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return [list(ids) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

    def _render(self, system: str | None, user: str) -> str:
        if self.has_template:
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": user}
            ]
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        bos = self.tok.bos_token or ""
        head = f"{system}\n\n" if system else ""
        return f"{bos}{head}{user}\nAnswer:"

    def chunk_text(self, chunk: Chunk) -> str:
        return chunk.text.strip() + "\n\n"

    def chunk_ids(self, chunk: Chunk) -> list[int]:
        """The token ids of ``chunk``'s segment: its text, between the packet's header and
        trailer ids when there is a packet."""
        return self.chunk_segment(chunk).ids

    def chunk_segment(self, chunk: Chunk) -> Segment:
        """``chunk``'s segment (``chunk_segments`` of one chunk)."""
        return self.chunk_segments([chunk])[0]

    def chunk_segments(self, chunks: list[Chunk]) -> list[Segment]:
        """The chunks' segments: their ids (``chunk_ids``) from the encodings cache when there
        is one, tokenized once per text, id, tokenizer and packet; the chunks not cached are
        tokenized together (``encode_many``)."""
        texts = [self.chunk_text(c) for c in chunks]
        head, tail = self.packet_ids or ([], [])
        if self.encodings is None:
            return [Segment("chunk", head + ids + tail, c) for c, ids in zip(chunks, self.encode_many(texts))]
        keys = [(t, c.id, self._identity, self._packet_identity) for t, c in zip(texts, chunks)]
        encs = self.encodings.get_many(
            keys, lambda missing: [head + ids + tail for ids in self.encode_many([k[0] for k in missing])])
        return [Segment("chunk", e.ids, c, e.memo) for c, e in zip(chunks, encs)]

    def prefix_segment(self, text: str) -> Segment:
        """The ``prefix`` segment of a rendered ``text``, from the encodings cache when there
        is one (a system prompt is shared by many requests)."""
        if self.encodings is None:
            return Segment("prefix", self.encode(text))
        enc = self.encodings.get((text, None, self._identity, "prefix"), lambda: self.encode(text))
        return Segment("prefix", enc.ids, None, enc.memo)

    def build(self, question: str, chunks: list[Chunk], system: str | None) -> list[Segment]:
        check_text(question, "question")
        if system is not None:
            if not isinstance(system, str):
                raise InvalidRequestError(f"system must be a str or None, got {type(system).__name__}")
            if system.strip():
                check_text(system, "system")
            else:
                system = None
        for i, c in enumerate(chunks):
            check_text(c.text, f"chunks[{i}].text")
        header = DOC_HEADER if chunks else ""
        rendered = self._render(system, f"{header}{DOCUMENTS_MARK}{QUESTION_HEADER}{question.strip()}")
        pre, post = rendered.split(DOCUMENTS_MARK)
        segs = [self.prefix_segment(pre)]
        segs += self.chunk_segments(chunks)
        segs.append(Segment("suffix", self.encode(post)))
        return segs

    def raw(self, prompt: str, chunks: list[Chunk]) -> list[Segment]:
        """A text completion's segments: the tokenizer's BOS as prefix, the ``chunks`` (each
        cached as in a chat request), then ``prompt`` as written: no chat template, no
        headers (OpenAI's legacy completions)."""
        check_text(prompt, "prompt")
        for i, c in enumerate(chunks):
            check_text(c.text, f"chunks[{i}].text")
        bos = self.tok.bos_token or ""
        return [self.prefix_segment(bos), *(self.chunk_segment(c) for c in chunks),
                Segment("suffix", self.encode(prompt))]
