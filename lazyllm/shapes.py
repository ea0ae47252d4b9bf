"""What a command line checks about a model before it loads it, with no torch or
transformers import: the model's shape read from its ``config.json``, where the default
model is unpacked, the tensor-parallel degrees the shape takes, the bytes of one KV page
and the GPUs present. Loading a model takes seconds to minutes; a flag that cannot work
with it is refused in well under a second with these.

A leaf module: it imports no layer of the package (the engine and the model loader import
it)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# bytes per element of the dtype option names (lazyllm.config.DTYPES)
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}
_SHAPE_KEYS = ("num_hidden_layers", "num_attention_heads", "hidden_size")


def cache_root() -> Path:
    """lazyllm's cache folder (``LAZYLLM_CACHE``, default ``~/.cache/lazyllm``)."""
    return Path(os.environ.get("LAZYLLM_CACHE", "~/.cache/lazyllm")).expanduser()


def model_shape(model: str | os.PathLike | None) -> SimpleNamespace | None:
    """The shape fields of ``model``'s ``config.json`` (a folder, or the default model once
    unpacked; a multimodal config's ``text_config``), with ``num_key_value_heads`` and
    ``head_dim`` filled in as transformers does; ``None`` where there is no readable config
    with the layers, heads and width (a ``.gguf`` file, a hub id: the loader checks those)."""
    folder = cache_root() / "models" / DEFAULT_MODEL_NAME if model is None else Path(model).expanduser()
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config") or cfg if isinstance(cfg, dict) else None
    if not isinstance(cfg, dict) or not all(isinstance(cfg.get(k), int) and cfg[k] > 0 for k in _SHAPE_KEYS):
        return None
    heads = cfg["num_attention_heads"]
    return SimpleNamespace(
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads, hidden_size=cfg["hidden_size"],
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg.get("intermediate_size"), max_position_embeddings=cfg.get("max_position_embeddings"))


def tensor_parallel_error(n: int, num_heads: int, num_kv_heads: int, intermediate: int) -> str | None:
    """Why ``n`` ranks cannot shard a model of these shapes (``None``: they can)."""
    for what, size in (("KV heads", num_kv_heads), ("attention heads", num_heads),
                       ("MLP intermediate size", intermediate)):
        if size % n:
            ok = [d for d in range(1, num_kv_heads + 1) if num_kv_heads % d == 0 and num_heads % d == 0
                  and intermediate % d == 0]
            return (f"tensor_parallel={n} does not divide the model's {what} ({size}); "
                    f"this model takes tensor_parallel in {ok}")
    return None


def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, element_bytes: int) -> int:
    """Bytes of one KV page: K and V of every layer for ``page_size`` tokens."""
    return 2 * num_layers * page_size * num_kv_heads * head_dim * element_bytes


def gpu_count() -> int:
    """The CUDA GPUs this process may use, without initializing CUDA: ``CUDA_VISIBLE_DEVICES``
    where set (its entries up to the first invalid one, as CUDA reads it), else the NVIDIA
    device files. A quick estimate for refusing a flag early; the engine counts again."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        n = 0
        for entry in visible.split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            n += 1
        return n
    try:
        return sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
    except OSError:
        return 0


def device_type(device: str | None) -> str:
    """``"cuda"`` or another device type of a ``device`` option, ``"auto"`` read as CUDA when
    a GPU is present (``gpu_count``)."""
    if device is None or device == "auto":
        return "cuda" if gpu_count() > 0 else "cpu"
    return str(device).split(":", 1)[0]


__all__ = ["DEFAULT_MODEL_NAME", "DTYPE_BYTES", "cache_root", "device_type", "gpu_count", "model_shape",
           "page_bytes", "tensor_parallel_error"]
