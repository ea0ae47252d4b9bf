"""Grammars compiled for one tokenizer, and the per-request token constraint built from them.

The grammar library is llguidance (BENCHMARKS.md, "CPU: structured output, grammar library"): a grammar is a string
(JSON Schema, regex or Lark), compiled against the tokenizer's vocabulary into a matcher that
gives, at each step, the set of tokens that keep the output inside the grammar as a bitmask.
Compiling (building the lexer over the vocabulary) costs milliseconds; a compiled matcher is
kept per grammar and each request starts from a copy of it (tens of microseconds).
"""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..errors import InvalidRequestError
from .bounds import JsonBounds
from .schema_errors import grammar_error

__all__ = ["GrammarCompiler", "GrammarConstraint"]


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor():
    """llguidance's thread pool for batched mask fills (one per process, made on first use)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


class _Refused(Exception):
    """llguidance refused a grammar (its full message, made one line by ``grammar_error``)."""


class GrammarConstraint:
    """One request's grammar state; the engine's ``TokenConstraint`` (``engine/running/sampler.py``).

    ``fill_bitmask(bitmask, row)`` writes the allowed next tokens into row ``row`` of an int32
    ``(B, ceil(V / 32))`` CPU tensor (bit ``j`` of word ``i`` allows token ``32 * i + j``);
    ``accept(token)`` advances (False: the token breaks the grammar); ``is_terminated()`` is
    True once the grammar is complete and admits nothing more.
    """

    def __init__(self, matcher, tokenizer_eos: int):
        self._m = matcher
        self._eos = tokenizer_eos

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, bitmask, row)

    @staticmethod
    def fill_bitmasks(items: list[tuple[GrammarConstraint, int]], bitmask: torch.Tensor) -> None:
        """Fill the rows of many constraints in one call, on llguidance's worker threads
        (``items``: ``(constraint, row)`` pairs)."""
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(_executor(), [(c._m, row) for c, row in items], bitmask)

    def accept(self, token: int) -> bool:
        return bool(self._m.consume_token(int(token)))

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def is_accepting(self) -> bool:
        """Whether the text so far is a complete sentence of the grammar."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class GrammarCompiler:
    """Compiles grammars for one tokenizer, keeping the last ``cache_size`` compiled ones.

    ``vocab_size`` is the model's (its logits' width), which may exceed the tokenizer's:
    tokens past the tokenizer are never allowed. Thread-safe.
    """

    def __init__(self, tokenizer, vocab_size: int, config=None, cache_size: int = 256):
        self._hf_tok, self._vocab = tokenizer, int(vocab_size)
        # the engine's bounds on JSON strings, arrays and free values, which every grammar built
        # for it applies
        self.bounds = JsonBounds() if config is None else JsonBounds(
            config.max_string_length, config.max_array_length, config.max_json_depth)
        self._ll_tok = None  # built on first use: seconds for a large vocabulary (BENCHMARKS.md)
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.stats = {"compiled": 0, "hits": 0}

    @property
    def max_string_length(self) -> int | None:
        return self.bounds.max_string_length

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def _tokenizer(self):
        if self._ll_tok is None:
            import llguidance.hf

            self._ll_tok = llguidance.hf.from_tokenizer(self._hf_tok, n_vocab=self._vocab)
        return self._ll_tok

    def compile(self, grammar: str, schemas: list = ()) -> None:
        """Compile ``grammar`` (an llguidance grammar string) into the cache; raises
        ``InvalidRequestError`` with a one-line reason when it is invalid or uses something
        the library does not implement (``schemas``: the JSON Schemas it was built from,
        which name the cause of a schema that describes no value)."""
        try:
            self._compiled(grammar)
        except _Refused as e:
            raise InvalidRequestError("unsupported or invalid grammar: " + grammar_error(str(e), schemas)) from None

    def _compiled(self, grammar: str):
        with self._lock:
            m = self._cache.get(grammar)
            if m is not None:
                self._cache.move_to_end(grammar)
                self.stats["hits"] += 1
                return m
            import llguidance
            import llguidance.torch

            tok = self._tokenizer()
            is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
            if is_error:
                raise _Refused("\n".join(messages))
            # errors are read through get_error(), not printed
            m = llguidance.LLMatcher(tok, grammar, log_level=0)
            # the lexer over the vocabulary is built lazily at the first mask: build it now so
            # that every request's copy starts with it
            llguidance.torch.fill_next_token_bitmask(m, llguidance.torch.allocate_token_bitmask(1, self._vocab), 0)
            if m.is_error():
                raise _Refused(m.get_error())
            self._cache[grammar] = m
            self.stats["compiled"] += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return m

    def constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh constraint for one request (a copy of the compiled matcher)."""
        try:
            m = self._compiled(grammar)
        except _Refused as e:
            raise InvalidRequestError("unsupported or invalid grammar: " + grammar_error(str(e))) from None
        with self._lock:
            copy = m.deep_copy()
        return GrammarConstraint(copy, self._tokenizer().eos_token)
