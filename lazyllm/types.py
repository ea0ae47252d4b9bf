"""Public value types: chunks, sampling options, results."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError


@dataclass(frozen=True)
class Chunk:
    """One retrieved document, handed to the engine as its own segment.

    The chunk's KV is cached under a hash of its *tokens* (and the model and context
    settings), so two chunks with the same text share KV whatever their ``id``.
    ``id`` and ``metadata`` travel with the chunk for the caller's benefit (citations,
    logging); they do not change the computation.
    """

    text: str
    id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if not isinstance(self.text, str):
            raise InvalidRequestError(f"Chunk.text must be a str, got {type(self.text).__name__}")
        if self.id is not None and not isinstance(self.id, str):
            object.__setattr__(self, "id", str(self.id))


def as_chunk(x: Any, index: int) -> Chunk:
    """Coerce a ``str`` or ``Chunk`` into a ``Chunk``; anything else is an error."""
    if isinstance(x, Chunk):
        return x
    if isinstance(x, str):
        return Chunk(x)
    raise InvalidRequestError(
        f"chunks[{index}] must be a str or lazyllm.Chunk, got {type(x).__name__}"
    )


MAX_CHUNKS = 4096


def as_chunks(chunks: Any) -> list[Chunk]:
    """A request's ``chunks`` argument as a list of ``Chunk`` (``None``: none): a list of
    ``str`` / ``Chunk``, at most ``MAX_CHUNKS``, where two chunks with one id carry one text."""
    if chunks is None:
        return []
    if isinstance(chunks, (str, Chunk)):
        raise InvalidRequestError("chunks must be a list of str or Chunk, not a single one")
    if not isinstance(chunks, Iterable):
        raise InvalidRequestError(f"chunks must be a list, got {type(chunks).__name__}")
    chunks = [as_chunk(c, i) for i, c in enumerate(chunks)]
    if len(chunks) > MAX_CHUNKS:
        raise InvalidRequestError(f"{len(chunks)} chunks; at most {MAX_CHUNKS} per request")
    seen: dict[str, str] = {}
    for c in chunks:
        if c.id is not None:
            if c.id in seen and seen[c.id] != c.text:
                raise InvalidRequestError(f"two chunks have id {c.id!r} but different text")
            seen[c.id] = c.text
    return chunks


DEFAULT_MAX_NEW_TOKENS = 64  # a generation's length limit where the caller gives none


@dataclass(frozen=True)
class SamplingParams:
    """Decoding options. ``temperature == 0`` is greedy; ``top_k == 0`` and
    ``top_p == 1`` switch those filters off; ``seed`` makes sampling reproducible."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        def bad(msg):
            raise InvalidRequestError(msg)

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            bad(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            bad(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                bad(f"{name} must be a number, got {v!r}")
        if not (0.0 <= self.temperature <= 100.0):
            bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an int >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad(f"seed must be an int or None, got {self.seed!r}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if stop is None:
            stop = ()
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            bad(f"stop must be a str or a list of str, got {self.stop!r}")
        if any(s == "" for s in stop):
            bad("stop strings must not be empty")
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **kw) -> SamplingParams:
        return dataclasses.replace(self, **kw)


@dataclass
class Usage:
    """Token counts of one request. ``cached_tokens`` counts prompt tokens whose KV was
    reused instead of computed (the shared system prefix included); ``cached_chunk_tokens``
    only those of chunks."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cached_chunk_tokens: int = 0  # the part of cached_tokens that belongs to chunks

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class Regex:
    """A ``response_format``: the answer must match ``pattern`` in full (Rust regex syntax:
    no look-around, no back-references)."""

    pattern: str


@dataclass(frozen=True)
class Grammar:
    """A ``response_format``: the answer is a sentence of this grammar, written in Lark
    (``start: ...``) or in GBNF/EBNF (``root ::= ...``)."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """One tool call made by the model: ``id`` (unique, to answer with a ``tool`` message
    carrying ``tool_call_id``), the tool's ``name`` and its ``arguments`` (a dict that
    validates against the tool's parameter schema). A call cut off by the length limit has
    ``partial``, its arguments' JSON as far as it was generated (``arguments`` then ``{}``)."""

    id: str
    name: str
    arguments: dict
    partial: str | None = None

    def to_openai(self) -> dict:
        """The OpenAI ``tool_calls`` item (arguments as a JSON string; cut off, as generated)."""
        import json

        args = self.partial if self.partial is not None else json.dumps(self.arguments)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability under the model (natural log, before
    temperature, top-k/top-p and any grammar mask: ``LazyLLM.score``'s value for it), and the
    most likely tokens at its place (``top_logprobs``, most likely first; empty unless asked)."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: tuple[TokenLogprob, ...] = ()

    def to_openai(self, top: bool = True) -> dict:
        """OpenAI's ``logprobs.content`` item (``token``, ``logprob``, UTF-8 ``bytes``,
        ``top_logprobs``)."""
        out = {"token": self.token, "logprob": self.logprob, "bytes": list(self.token.encode("utf-8"))}
        if top:
            out["top_logprobs"] = [t.to_openai(top=False) for t in self.top_logprobs]
        return out


@dataclass
class GenerationOutput:
    """Result of one request.

    ``prompt_segments`` is a list of ``(kind, token_ids)`` with kind in
    ``prefix``/``chunk``/``suffix``; concatenated, they are exactly the logical token
    sequence the model saw. ``ttft_s`` is the time from the caller's call (or the server's
    receipt of the request) to the first token: tokenizing and building the request included;
    ``engine_ttft_s`` the part from the engine's receipt of the built request, and ``queue_s``
    the part of that spent waiting to be scheduled. ``total_s`` counts from the call too.
    """

    text: str
    token_ids: list[int]
    prompt_segments: list[tuple[str, list[int]]]
    usage: Usage
    finish_reason: str  # "stop" (EOS, stop string, grammar complete), "length" or "tool_calls"
    ttft_s: float
    total_s: float
    queue_s: float = 0.0
    chunk_ids: list[str | None] = field(default_factory=list)
    # with ``response_format``: the parsed answer (a Pydantic instance, a dict or list, or the
    # matched str); None when generation stopped before the answer was complete ("length")
    parsed: Any = None
    # with ``tools``: the calls the model made (finish_reason "tool_calls"); ``text`` keeps
    # the generated text they were parsed from
    tool_calls: list[ToolCall] = field(default_factory=list)
    # with ``tools``: the answer is calls, even one cut off before a call was named; then
    # ``text`` is call markup, never content
    answer_is_calls: bool = False
    engine_ttft_s: float = 0.0
    # with ``logprobs=True``: one per generated token (an end-of-sequence token excluded)
    logprobs: list[TokenLogprob] | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return [t for _, seg in self.prompt_segments for t in seg]

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        n = self.usage.completion_tokens
        return (self.total_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


@dataclass
class ScoreOutput:
    """Teacher-forced scores of a continuation: ``logprobs[i]`` is the log-probability of
    ``token_ids[i]`` given everything before it; ``logits`` is ``(len(token_ids), vocab)``
    when asked for. ``prefilled_tokens`` counts the prompt and continuation tokens computed
    (not reused). ``ttft_s``: from the call to the scores; ``engine_ttft_s``: from the engine's
    receipt of the request."""

    token_ids: list[int]
    logprobs: list[float]
    logits: Any
    prompt_segments: list[tuple[str, list[int]]]
    usage: Usage
    prefilled_tokens: int
    ttft_s: float
    engine_ttft_s: float = 0.0
    # with ``top_logprobs=k``: per token, the ``k`` most likely ``(token_id, logprob)`` pairs
    top_logprobs: list[list[tuple[int, float]]] | None = None
