"""The server's request limits, and what ``lazyllm serve`` checks before the model loads,
beyond each flag on its own: the server limits together, a packet file that must exist, and
the engine options against the model's shape read from its ``config.json`` (the KV pool
must hold a page; tensor parallelism must divide the heads and find its GPUs). Loading a
model takes seconds to minutes; a flag that cannot work is refused in well under a second
instead. Light to import: no torch, transformers or engine (``lazyllm.shapes``)."""
from __future__ import annotations

import argparse
from pathlib import Path

from lazyllm.config import EngineConfig
from lazyllm.shapes import DTYPE_BYTES, device_type, gpu_count, model_shape, page_bytes, tensor_parallel_error

__all__ = ["DEFAULT_MAX_CONCURRENCY", "DEFAULT_MAX_NEW_TOKENS_LIMIT", "DEFAULT_MAX_REQUEST_BYTES",
           "DEFAULT_MAX_TOKENS", "preflight_problems"]

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
DEFAULT_MAX_NEW_TOKENS_LIMIT = 4096
DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_CONCURRENCY = 256


def _pool_problem(config: EngineConfig, shape) -> str | None:
    if config.kv_cache_bytes is None:
        return None
    kv_heads, head_dim, layers = shape.num_key_value_heads, shape.head_dim, shape.num_hidden_layers
    page = config.page_size or 16  # the smallest page the engine picks by itself: a lower bound
    if isinstance(config.dtype, str) and config.dtype in DTYPE_BYTES:
        size = DTYPE_BYTES[config.dtype]
    elif config.dtype in (None, "auto"):  # bfloat16 on CUDA, float32 on CPU
        size = 2 if device_type(config.device) == "cuda" else 4
    else:  # a torch dtype
        size = config.dtype.itemsize
    need = page_bytes(layers, kv_heads, head_dim, page, size)
    if config.kv_cache_bytes < need:
        return (f"--kv-cache-bytes {config.kv_cache_bytes} is smaller than one KV page of this model ({need} bytes: "
                f"{layers} layers x K and V x {kv_heads} KV heads x {head_dim} x {page} tokens x {size} bytes)")
    return None


def _tensor_parallel_problem(config: EngineConfig, shape) -> str | None:
    n = config.tensor_parallel
    if n == 1:
        return None
    err = tensor_parallel_error(n, shape.num_attention_heads, shape.num_key_value_heads,
                                shape.intermediate_size or shape.num_attention_heads)
    if err is None and device_type(config.device) == "cuda" and n > gpu_count():
        err = f"tensor_parallel={n} needs {n} GPUs; {gpu_count()} present"
    return f"--tensor-parallel {n}: {err}" if err else None


def preflight_problems(args: argparse.Namespace, config: EngineConfig) -> list[str]:
    """Every problem of the parsed flags that shows before the model loads, one sentence
    each; reads the model's ``config.json`` only (no torch, no weights)."""
    bad = []
    if args.default_max_tokens > args.max_tokens_limit:
        bad.append(f"--default-max-tokens {args.default_max_tokens} is above --max-tokens-limit "
                   f"{args.max_tokens_limit}")
    p = config.packets
    if isinstance(p, str) and p != "auto" and not Path(p).expanduser().is_file():
        bad.append(f"--packets {p}: no such packet file (train one with `lazyllm adapt`)")
    shape = model_shape(args.model)
    if shape is None:
        return bad
    context = shape.max_position_embeddings
    if context and args.default_max_tokens >= context:
        bad.append(f"--default-max-tokens {args.default_max_tokens} leaves no room for a prompt in the model's "
                   f"context of {context} tokens")
    bad += [p for p in (_pool_problem(config, shape), _tensor_parallel_problem(config, shape)) if p]
    return bad
