"""Grammar libraries side by side on one tokenizer: compile time per grammar and mask time
per token (xgrammar vs llguidance), on the CPU this runs on.

    python benchmarks/grammar_libs.py [--tokenizer DIR] [--steps 300]

Compile: a fresh compiler (no cache) per grammar, median of 5. Mask: a random walk through
the grammar (each step fills the next-token bitmask, picks a uniformly random allowed token,
accepts it; restarts when the grammar ends), mean over ``--steps`` tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "vip"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {
            "street": {"type": "string"}, "city": {"type": "string"},
            "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"], "additionalProperties": False}},
            "required": ["street", "city", "geo"], "additionalProperties": False},
        "orders": {"type": "array", "items": {"type": "object", "properties": {
            "id": {"type": "integer"}, "total": {"type": "number"}, "paid": {"type": "boolean"}},
            "required": ["id", "total", "paid"], "additionalProperties": False}},
    },
    "required": ["name", "age", "address", "orders"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,9} [0-9]{1,3}(\.[0-9]{1,2})? (USD|EUR|GBP)"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
EBNF = r'''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
'''


def choices_regex(choices):
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def allowed(bitmask_row: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


class XG:
    name = "xgrammar"

    def __init__(self, tok):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.vocab = len(tok)

    def compile(self, kind, spec):
        c = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(spec), any_whitespace=False)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        if kind in ("regex", "choices"):
            return c.compile_regex(spec if kind == "regex" else choices_regex(spec))
        return c.compile_grammar(spec)

    def walk(self, compiled, steps, rng):
        m = self.xgr.GrammarMatcher(compiled)
        bm = self.xgr.allocate_token_bitmask(1, self.vocab)
        t_mask = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(bm, 0)
            t_mask += time.perf_counter() - t0
            ok = allowed(bm[0], self.vocab)
            t0 = time.perf_counter()
            assert m.accept_token(int(rng.choice(ok)))
            t_mask += time.perf_counter() - t0
            if m.is_terminated():
                m.reset()
        return t_mask / steps


class LLG:
    name = "llguidance"

    def __init__(self, tok):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
        self.vocab = len(tok)

    def grammar(self, kind, spec):
        M = self.llg.LLMatcher
        if kind == "json_schema":
            return M.grammar_from_json_schema(json.dumps(spec))
        if kind == "json_object":
            return M.grammar_from_json_schema('{"type": "object"}')
        if kind in ("regex", "choices"):
            return M.grammar_from_regex(spec if kind == "regex" else choices_regex(spec))
        from llguidance.gbnf_to_lark import gbnf_to_lark

        return M.grammar_from_lark(gbnf_to_lark(spec))

    def compile(self, kind, spec):
        m = self.llg.LLMatcher(self.tok, self.grammar(kind, spec))
        # the lexer is built lazily: the first mask is part of compiling
        bm = self.lt.allocate_token_bitmask(1, self.vocab)
        self.lt.fill_next_token_bitmask(m, bm, 0)
        assert not m.is_error(), m.get_error()
        return self.grammar(kind, spec)

    def walk(self, grammar, steps, rng):
        m = self.llg.LLMatcher(self.tok, grammar)
        bm = self.lt.allocate_token_bitmask(1, self.vocab)
        t_mask = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            self.lt.fill_next_token_bitmask(m, bm, 0)
            t_mask += time.perf_counter() - t0
            ok = allowed(bm[0], self.vocab)
            t0 = time.perf_counter()
            assert m.consume_token(int(rng.choice(ok))), m.get_error()
            t_mask += time.perf_counter() - t0
            if m.is_stopped():
                m = self.llg.LLMatcher(self.tok, grammar)
        return t_mask / steps


CASES = [("nested JSON Schema", "json_schema", NESTED), ("json_object", "json_object", None),
         ("regex", "regex", REGEX), ("choices", "choices", CHOICES), ("EBNF", "ebnf", EBNF)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    if args.tokenizer is None:
        from lazyllm.model.loader import default_model_dir

        args.tokenizer = str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    torch.set_num_threads(1)
    print(f"tokenizer {args.tokenizer} (vocab {len(tok)})")
    print("| grammar | library | compile ms (median of 5) | mask+accept us/token |")
    print("| --- | --- | --- | --- |")
    for lib_cls in (XG, LLG):
        t0 = time.perf_counter()
        lib = lib_cls(tok)
        print(f"| (tokenizer setup) | {lib.name} | {1e3 * (time.perf_counter() - t0):.0f} | |")
        for label, kind, spec in CASES:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                g = lib.compile(kind, spec)
                times.append(time.perf_counter() - t0)
            per_tok = lib.walk(g, args.steps, np.random.default_rng(0))
            print(f"| {label} | {lib.name} | {1e3 * statistics.median(times):.1f} | {1e6 * per_tok:.0f} |")


if __name__ == "__main__":
    main()
