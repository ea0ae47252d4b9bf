"""What ``lazyllm serve`` checks before the model loads, beyond each flag on its own: the
server limits together, a packet file that must exist, and the engine options against the
model's shape read from its ``config.json`` (the KV pool must hold a page; tensor parallelism
must divide the heads and find its GPUs). Loading a model takes seconds to minutes; a flag
that cannot work is refused in well under a second instead."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lazyllm.config import EngineConfig

__all__ = ["preflight_problems", "model_config"]


def model_config(model: str | None) -> Any:
    """The transformers config of ``model`` when it can be read without loading weights or
    using the network (a folder with ``config.json``, or the default model once unpacked);
    else None (a ``.gguf`` file, a hub id: the engine checks those when it loads)."""
    from lazyllm.model.loader import DEFAULT_MODEL_NAME, cache_root

    folder = cache_root() / "models" / DEFAULT_MODEL_NAME if model is None else Path(model).expanduser()
    if not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception:  # noqa: BLE001  (an unreadable config is the loader's to report, with its context)
        return None


def _pool_problem(config: EngineConfig, cfg: Any) -> str | None:
    import torch

    from lazyllm.cache.store import PagePool
    from lazyllm.config import resolve_device, resolve_dtype

    if config.kv_cache_bytes is None:
        return None
    device = resolve_device(config.device)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    page = config.page_size or 16  # the smallest page the engine picks by itself: a lower bound
    dtype = resolve_dtype(config.dtype, device)
    need = PagePool.page_bytes(cfg.num_hidden_layers, kv_heads, head_dim, page, dtype)
    if config.kv_cache_bytes < need:
        return (f"--kv-cache-bytes {config.kv_cache_bytes} is smaller than one KV page of this model ({need} bytes: "
                f"{cfg.num_hidden_layers} layers x K and V x {kv_heads} KV heads x {head_dim} x {page} tokens x "
                f"{torch.empty((), dtype=dtype).element_size()} bytes)")
    return None


def preflight_problems(args: argparse.Namespace, config: EngineConfig) -> list[str]:
    """Every problem of the parsed flags that shows before the model loads, one sentence each."""
    bad = []
    if args.default_max_tokens > args.max_tokens_limit:
        bad.append(f"--default-max-tokens {args.default_max_tokens} is above --max-tokens-limit "
                   f"{args.max_tokens_limit}")
    p = config.packets
    if isinstance(p, str) and p != "auto" and not Path(p).expanduser().is_file():
        bad.append(f"--packets {p}: no such packet file (train one with `lazyllm adapt`)")
    cfg = model_config(args.model)
    if cfg is None:
        return bad
    context = getattr(cfg, "max_position_embeddings", None)
    if context and args.default_max_tokens >= context:
        bad.append(f"--default-max-tokens {args.default_max_tokens} leaves no room for a prompt in the model's "
                   f"context of {context} tokens")
    problem = _pool_problem(config, cfg)
    if problem:
        bad.append(problem)
    if config.tensor_parallel > 1:
        from lazyllm.config import resolve_device
        from lazyllm.engine.tp_runner import check_group
        from lazyllm.errors import InvalidRequestError

        try:
            check_group(config.tensor_parallel, cfg, resolve_device(config.device))
        except InvalidRequestError as e:
            bad.append(f"--tensor-parallel {config.tensor_parallel}: {e}")
    return bad
