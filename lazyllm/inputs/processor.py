"""``InputProcessor``: the one place a ``Request`` is made, complete.

Every request the engine runs (``generate``, ``stream``, ``score``, ``warm``, the warm-up's
synthetic ones) comes out of here with all it needs: its prompt segments (packets around the
chunks, the prompt layout of the configuration), its sampling parameters and seed, its
structured-output constraint and the ``finalize`` that parses the finished text, its
detokenizer, its deadline, and for scoring its ``Scoring``. Nothing downstream fills a field
in later.
"""
from __future__ import annotations

import queue
import secrets
import time
from collections.abc import Sequence
from typing import Any

from ..cache.store import segment_keys
from ..engine.detokenizer import Detokenizer
from ..engine.request import Request, Scoring, Segment
from ..errors import ContextLengthError, InvalidRequestError
from ..types import DEFAULT_MAX_NEW_TOKENS, Chunk, GenerationOutput, SamplingParams, as_chunks
from .conversation import render_request
from .prompt import PromptBuilder, check_text


def _received(received_at) -> float:
    """``received_at`` checked, or now."""
    if received_at is None:
        return time.perf_counter()
    if not isinstance(received_at, (int, float)) or isinstance(received_at, bool):
        raise InvalidRequestError(f"received_at must be a time.perf_counter() value, got {received_at!r}")
    return float(received_at)


class InputProcessor:
    """Turns a caller's arguments into engine ``Request`` values for one model.

    ``tokenizer``: the model's; ``prompts``: the prompt builder of the configuration
    (``prompt_builder``); ``max_context``, ``vocab_size``: the model's, in tokens;
    ``fingerprint``: the engine's cache-key fingerprint, given to hash a request's prefix and
    chunk keys here, off the engine thread, into its cached encodings (``None``: the planner
    hashes them)."""

    def __init__(self, tokenizer, prompts: PromptBuilder, *, max_context: int, vocab_size: int, config=None,
                 fingerprint: str | None = None):
        self.tokenizer, self.prompts = tokenizer, prompts
        self.max_context, self.vocab_size = max_context, vocab_size
        self.config = config  # the engine's options (the grammars' string bound)
        self.fingerprint = fingerprint
        self._grammar_compiler = None

    # -- the requests --------------------------------------------------------------
    def generation(self, question, chunks=None, system=None, *, max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
                   temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None, timeout=None, response_format=None,
                   tools=None, tool_choice=None, messages=None, parallel_tool_calls=False, streaming=True,
                   logprobs=False, top_logprobs=0, raw=False, received_at=None) -> Request:
        """A request to answer ``question`` over ``chunks`` (``LazyLLM.generate``'s arguments);
        raises ``InvalidRequestError`` / ``ContextLengthError`` for what cannot run.
        ``received_at``: the ``time.perf_counter()`` of the caller's call or of the server's
        receipt of the request, where its ``ttft_s`` counts from (``None``: now)."""
        received_at = _received(received_at)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, stop=() if stop is None else stop)
        if params.max_new_tokens > self.max_context:
            raise InvalidRequestError(f"max_new_tokens={params.max_new_tokens} exceeds the model's context "
                                      f"({self.max_context} tokens)")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise InvalidRequestError(f"timeout must be a positive number of seconds, got {timeout!r}")
        top = _top_logprobs(logprobs, top_logprobs)
        structured = self._structured(response_format, tools, tool_choice, parallel_tool_calls)
        if raw:  # a text completion: the prompt as written, after the chunks
            if messages is not None or system is not None or (structured is not None and structured.tools):
                raise InvalidRequestError("raw=True completes a prompt as written: no messages, system or tools")
            segs = self.prompts.raw(question, as_chunks(chunks))
        else:
            segs = render_request(self.prompts, question, as_chunks(chunks), system, messages, structured)
        self.check_fits(sum(len(s.ids) for s in segs), params.max_new_tokens)
        constraint = None
        if structured is not None and structured.grammar is not None:
            constraint = self.grammars.constraint(structured.grammar)
        return self._make(segs, params, streaming=streaming, timeout=timeout, constraint=constraint,
                          finalize=structured.finalize if structured is not None else None, received_at=received_at,
                          logprobs=top, scoring_of=None if top is None else self.scoring_after)

    def warming(self, chunks: Sequence[Chunk], system: str | None) -> Request:
        """A request that only computes and caches the KV of ``chunks`` and of the prefix."""
        segs = self.prompts.build("warm", as_chunks(chunks), system)[:-1] + [Segment("suffix", [])]
        params = SamplingParams(max_new_tokens=1)
        self.check_fits(sum(len(s.ids) for s in segs), 1)
        return self._make(segs, params, streaming=False, warm_only=True)

    def scoring(self, question, chunks, system, continuation: Sequence[int] | str,
                return_logits: bool = False, received_at: float | None = None) -> Request:
        """A request for the teacher-forced log-probabilities of ``continuation`` (token ids
        or a text) after the prompt of ``question`` over ``chunks``."""
        received_at = _received(received_at)
        cont = self._continuation(continuation)
        params = SamplingParams(max_new_tokens=1)
        prompt = self.prompts.build(question, as_chunks(chunks), system)
        self.check_fits(sum(len(s.ids) for s in prompt) + len(cont), 1)
        segs = prompt[:-1] + [Segment("suffix", prompt[-1].ids + cont[:-1])]
        return self._make(segs, params, streaming=False, score=Scoring(cont, prompt, bool(return_logits)),
                          received_at=received_at)

    def scoring_after(self, r: Request, cont: list[int], out: GenerationOutput) -> Request:
        """The scoring request of generation ``r``'s tokens ``cont``, teacher-forced after
        ``r``'s own prompt segments (so its scores are ``score``'s): it answers on ``r``'s
        event queue, is cancelled with ``r``, and completes ``out`` with its log-probabilities
        (``OutputProcessor.done_score``)."""
        segs = r.segments[:-1] + [Segment("suffix", r.segments[-1].ids + cont[:-1])]
        req = self._make(segs, SamplingParams(max_new_tokens=1), streaming=False, received_at=r.received_at,
                         score=Scoring(cont, r.segments, top=r.logprobs or 0, fills=out))
        req.events, req.cancelled, req.deadline = r.events, r.cancelled, r.deadline
        return req

    def synthetic(self, prefix: list[int], chunks: list[list[int]], question: list[int], chunk: Chunk,
                  max_new_tokens: int = 1, *, constraint=None, **sampling) -> Request:
        """A request of given token ids (the warm-up's, of exact sizes): ``prefix``, one chunk
        segment per list in ``chunks`` (each carrying ``chunk``), and ``question`` as suffix."""
        segs = [Segment("prefix", list(prefix)), *(Segment("chunk", c, chunk) for c in chunks),
                Segment("suffix", list(question))]
        params = SamplingParams(max_new_tokens=max_new_tokens, **sampling)
        return self._make(segs, params, streaming=False, constraint=constraint)

    def _make(self, segs: list[Segment], params: SamplingParams, *, streaming: bool, timeout: float | None = None,
              **fields: Any) -> Request:
        """The one ``Request`` constructor call: the seed drawn now when the caller gave none, so a
        sampled request draws the same tokens whatever it is batched with."""
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        self._hash_keys(segs)
        now = time.perf_counter()
        deadline = None if timeout is None else now + timeout
        fields.setdefault("received_at", now)
        return Request(segments=segs, params=params, events=queue.Queue(), streaming=streaming, seed=seed,
                       detok=Detokenizer(self.tokenizer, params.stop), deadline=deadline, submit_time=now, **fields)

    def _hash_keys(self, segs: list[Segment]) -> None:
        """Fill the cached encodings' key memos (``Segment.memo``) with this request's keys, so
        the planner finds them: a chunk is hashed once, here, not per request on the engine
        thread."""
        c = self.config
        if self.fingerprint is None or c is None or not c.mode.caches_chunks or len(segs) < 2:
            return
        if any(s.memo is not None for s in segs[:-1]):
            segment_keys(self.fingerprint, c.chunk_context, segs[0].ids, [s.ids for s in segs[1:-1]],
                         [s.memo for s in segs[:-1]])

    # -- checks and parts ------------------------------------------------------------
    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """Raise ``ContextLengthError`` unless ``n_prompt`` prompt tokens and every one of the
        ``max_new_tokens`` asked for fit the model's context (as OpenAI: refused before any
        compute)."""
        if n_prompt + max_new_tokens > self.max_context:
            raise ContextLengthError(
                f"the request has {n_prompt} prompt tokens and asks for up to {max_new_tokens} new ones; the "
                f"model's context is {self.max_context} tokens (shorten the prompt or lower max_new_tokens / "
                "max_tokens)")

    def _continuation(self, continuation) -> list[int]:
        if isinstance(continuation, str):
            check_text(continuation, "continuation")
            cont = self.prompts.encode(continuation)
        elif isinstance(continuation, Sequence) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in continuation):
            cont = list(continuation)
        else:
            raise InvalidRequestError("continuation must be a str or a list of token ids")
        if not cont or any(t < 0 or t >= self.vocab_size for t in cont):
            raise InvalidRequestError(f"continuation must be non-empty token ids in [0, {self.vocab_size})")
        return cont

    @property
    def grammars(self):
        """Grammars compiled for this model's tokenizer (built on first use)."""
        if self._grammar_compiler is None:
            from ..structured import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.config)
        return self._grammar_compiler

    def _structured(self, response_format, tools, tool_choice, parallel_tool_calls):
        if response_format is None and tools is None and tool_choice is None:
            return None
        from ..structured import prepare

        return prepare(self.grammars, response_format, tools, tool_choice, parallel_tool_calls)


__all__ = ["InputProcessor"]


MAX_TOP_LOGPROBS = 20  # OpenAI's bound


def _top_logprobs(logprobs: Any, top_logprobs: Any) -> int | None:
    """The request's ``Request.logprobs``: None (not asked) or the count of most likely
    tokens per place; raises ``InvalidRequestError`` as OpenAI refuses the pair."""
    if not isinstance(logprobs, bool):
        raise InvalidRequestError(f"logprobs must be a bool, got {logprobs!r}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) or not \
            0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs!r}")
    if top_logprobs and not logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=True")
    return top_logprobs if logprobs else None
