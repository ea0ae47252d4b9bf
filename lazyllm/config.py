"""``EngineConfig``: every engine option of ``LazyLLM``, validated once.

``LazyLLM(...)`` builds one from its keyword arguments (``EngineConfig.resolve``: a quality
preset first, then the options passed explicitly) and hands it to the engine, the KV planner,
recovery and the attention backend, which trust it. ``llm.config`` is the running
configuration, with the values chosen at load time (device, dtype, page size, pool bytes,
backend) filled in.

Each field's ``metadata`` carries ``help`` and, where the values are a fixed set,
``choices``: a command line or a server builds its flags from ``dataclasses.fields``.

Quality recovery's token selections are a registry (``register_selection``): the engine
registers its own, a benchmark may register more, and ``recompute_selection`` is checked
against the names registered.

Light to import (no torch: the module imports it where a device or dtype is resolved), so a
command line checks its flags before it pays for torch and transformers.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import InvalidRequestError
from .kernels.options import calibration_on, calibration_problems
from .option_docs import OPTION_DOCS
from .presets import PRESETS, QUALITY_OPTIONS
from .reuse_modes import CHUNK_CACHING_MODES, MODES, REUSE_MODES, ReuseMode

log = logging.getLogger("lazyllm")

if TYPE_CHECKING:
    import torch

    from .kernels.options import KernelOptions

CHUNK_CONTEXTS = ("isolated", "prefix")
BACKENDS = ("auto", "torch", "triton")
# dtype option names -> the torch dtype's name (``getattr(torch, ...)``)
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
# the device strings checked without torch; any other string is checked by ``torch.device``
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu|meta)(:\d+)?")
BUILTIN_SELECTIONS = ("deviation", "attention", "two-stage")
# a JSON string's length bound under constrained decoding, where the schema sets none
# (characters): long enough for names, sentences and short paragraphs, short enough that a
# model which never closes its string stops within a few hundred tokens
DEFAULT_MAX_STRING_LENGTH = 256
# an array's length bound where the schema sets no maxItems, and how deep a value the schema
# leaves free (json_object, {}, an object's other keys) may nest: a model that never closes an
# array, or keeps opening objects, stops there instead of running to the token limit
DEFAULT_MAX_ARRAY_LENGTH = 32
DEFAULT_MAX_JSON_DEPTH = 8

# -- recovery selections ----------------------------------------------------------------
# name -> scorer(recovery, request, n_pick, exclude) -> (chunk tokens,) scores, higher first
_SELECTIONS: dict[str, Callable] = {}


def register_selection(name: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(recovery, request, n_pick, exclude)`` as the token selection
    ``name`` of quality recovery (``recompute_selection=name``). ``fn`` returns a score per
    chunk token of the request, in chunk order, ``(chunk tokens,)`` float; the ``n_pick``
    highest finite scores are recomputed. ``exclude`` (bool, chunk order, or ``None``) marks
    tokens that will not be picked whatever their score. Registering another function under
    a taken name raises ``ValueError``; the same function again is a no-op."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a selection name must be a non-empty str, got {name!r}")

    def add(fn: Callable) -> Callable:
        old = _SELECTIONS.get(name)
        if old is not None and old is not fn:
            raise ValueError(f"recovery selection {name!r} is already registered")
        _SELECTIONS[name] = fn
        return fn

    return add


def selection_names() -> tuple[str, ...]:
    """The registered recovery selections, in registration order."""
    return tuple(_SELECTIONS)


def selection(name: str) -> Callable:
    """The scorer registered as ``name`` (``KeyError`` if none)."""
    return _SELECTIONS[name]


# -- the configuration ------------------------------------------------------------------
# what each option does, in full (``lazyllm.option_docs``): LazyLLM's docstring (``options_docstring``)
# and docs/guide.md's option table (``options_markdown``) are made from it


def _opt(default: Any, help: str, choices: tuple | None = None, **kw) -> Any:
    meta = {"help": help} if choices is None else {"help": help, "choices": choices}
    return field(default=default, metadata=meta, **kw)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class EngineConfig:
    """The engine options of ``LazyLLM`` (see its docstring for each in full). Validated when
    made: every bad option is named in one ``InvalidRequestError``. ``None`` for ``dtype``,
    ``kv_cache_bytes``, ``page_size`` and ``overlap_decode`` means "chosen at load time" (the
    running ``llm.config`` holds the value chosen). Make one with a preset through
    ``resolve``; made directly, every value is taken as given."""

    device: str = _opt("auto", "'auto' (CUDA when present), 'cpu', 'cuda', 'cuda:1'...")
    dtype: Any = _opt(None, "None/'auto': float32 on CPU, bfloat16 on CUDA; or a dtype name",
                      choices=(None, "auto", *DTYPES))
    reuse: str = _opt(QUALITY_OPTIONS["reuse"], "how chunk KV is reused", REUSE_MODES)
    chunk_context: str = _opt(QUALITY_OPTIONS["chunk_context"],
                              "what a cached chunk attends to: itself, or the system prefix and itself",
                              CHUNK_CONTEXTS)
    kv_cache_bytes: int | None = _opt(None, "bytes of the KV page pool (default: 1 GiB on CPU, 40% of free "
                                            "GPU memory)")
    page_size: int | None = _opt(None, "tokens per KV page, a power of two (default: 64 with Triton on CUDA, "
                                       "else 16)")
    attention_backend: str = _opt("auto", "attention kernels: 'auto' (Triton on CUDA, torch on CPU)", BACKENDS)
    max_batch_tokens: int = _opt(8192, "prefill tokens per forward")
    mixed_steps: bool = _opt(False, "one forward per step carries the decode tokens and the next prefill work")
    step_token_budget: int = _opt(2048, "tokens per mixed step, decode rows included (mixed_steps)")
    recompute_first_tokens: int = _opt(QUALITY_OPTIONS["recompute_first_tokens"],
                                       "recompute this many first tokens of every chunk with full context")
    recompute_ratio: float = _opt(QUALITY_OPTIONS["recompute_ratio"],
                                  "also recompute this fraction of chunk tokens with full context, in [0, 1]")
    recompute_selection: str = _opt(QUALITY_OPTIONS["recompute_selection"],
                                    "how recompute_ratio picks its tokens", BUILTIN_SELECTIONS)
    recompute_selection_depth: float = _opt(QUALITY_OPTIONS["recompute_selection_depth"],
                                            "the leading fraction of the layers whose attention the 'attention' and "
                                            "'two-stage' selections sum, in (0, 1]")
    context_temperature: float = _opt(QUALITY_OPTIONS["context_temperature"],
                                      "divide the documents' attention logits by this (1: off)")
    context_lse_scale: float = _opt(QUALITY_OPTIONS["context_lse_scale"],
                                    "scale the documents' attention log-sum-exp by this (1: off)")
    escalate_below: float = _opt(QUALITY_OPTIONS["escalate_below"],
                                 "answer with full attention a request whose first answer token's top-2 "
                                 "probability margin after reuse is below this, in [0, 1] (0: never)")
    escalate_tokens: int = _opt(QUALITY_OPTIONS["escalate_tokens"],
                                "escalate_below checks this many first answer tokens, 1-64")
    quality: str | None = _opt(None, "a named fidelity preset; explicit options override it",
                               (None, *PRESETS))
    kv_disk_dir: str | os.PathLike | None = _opt(None, "folder of a persistent chunk KV tier")
    kv_disk_bytes: int = _opt(16 << 30, "size cap of the persistent tier, bytes")
    trust_remote_code: bool = _opt(False, "let transformers run the checkpoint's own code")
    progress: bool = _opt(True, "show loading progress")
    batch_invariant: bool = _opt(False, "compute every token as it would be computed alone (slower)")
    cuda_graphs: bool = _opt(True, "replay decode steps and short prefills from CUDA graphs (CUDA only); False runs "
                             "every step eagerly")
    overlap_decode: bool | None = _opt(None, "launch decode step n+1 before reading step n (None: where decode "
                                             "runs from CUDA graphs)")
    kernel_options: KernelOptions | None = _opt(None, "lazyllm.KernelOptions for the Triton launches")
    tensor_parallel: int = _opt(1, "shard the model over this many processes, one per GPU")
    warmup: bool = _opt(True, "before the first request, launch every kernel specialization and capture the CUDA "
                              "graphs a workload uses (CUDA; nothing to do on CPU)")
    packets: Any = _opt("auto", "learned chunk packets: a packet file, a lazyllm Packets, 'auto' (the one "
                                "shipped for the model, if any) or None")
    max_string_length: int | None = _opt(DEFAULT_MAX_STRING_LENGTH, "under a JSON response_format or tools, the "
                                         "longest string the model may write where the schema sets no maxLength "
                                         "(characters; None: unbounded)")
    max_array_length: int | None = _opt(DEFAULT_MAX_ARRAY_LENGTH, "under a JSON response_format or tools, the most "
                                        "items an array may hold where the schema sets no maxItems (None: unbounded)")
    max_json_depth: int | None = _opt(DEFAULT_MAX_JSON_DEPTH, "under a JSON response_format or tools, how deep "
                                      "(arrays and objects) a value the schema leaves free may nest (None: "
                                      "unbounded)")

    def __post_init__(self):
        bad = _problems(self)
        if bad:
            raise InvalidRequestError("; ".join(bad))
        # numbers in one type, whatever the caller passed (``1`` and ``1.0`` the same config)
        for name in ("recompute_ratio", "context_temperature", "context_lse_scale", "escalate_below"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @classmethod
    def resolve(cls, quality: str | None = None, **explicit) -> EngineConfig:
        """The configuration of preset ``quality`` (``None``: each option's default) with the
        options in ``explicit`` taking precedence; for the options a preset sets
        (``QUALITY_OPTIONS``), ``None`` means "not given". Raises ``InvalidRequestError`` for
        an unknown option or preset and for bad values.

        With ``tensor_parallel`` > 1, or a packet given (a file or ``Packets``: packets are
        trained for isolated chunks), and neither a preset nor a quality option given, the
        options are ``quality="isolated"``'s (logged): tensor parallelism does not run the
        default's recompute yet, and a packet belongs to isolated chunks without it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(explicit) - names)
        if unknown:
            raise InvalidRequestError(f"unknown engine option(s): {', '.join(unknown)}")
        if quality is not None and quality not in PRESETS:
            raise InvalidRequestError(f"quality must be one of {tuple(PRESETS)} or None, got {quality!r}")
        tp, pk = explicit.get("tensor_parallel"), explicit.get("packets")
        if quality is None and all(explicit.get(k) is None for k in QUALITY_OPTIONS):
            if isinstance(tp, int) and tp > 1:
                log.warning("tensor_parallel=%d does not run the default's recompute yet: running "
                            "quality='isolated' (pass quality= to choose another)", tp)
                quality = "isolated"
            elif pk is not None and not (isinstance(pk, str) and pk == "auto"):
                log.info("a packet is trained for isolated chunks: running quality='isolated'")
                quality = "isolated"
        values = dict(PRESETS[quality]) if quality is not None else {}
        values.update({k: v for k, v in explicit.items() if v is not None or k not in QUALITY_OPTIONS})
        return cls(quality=quality, **values)

    @property
    def mode(self) -> ReuseMode:
        """The reuse mode (``lazyllm.reuse_modes``): whether it caches chunks, makes copies..."""
        return MODES[self.reuse]

    @property
    def calibration(self) -> tuple[float, float]:
        """``(context_temperature, context_lse_scale)``; off or on as
        ``lazyllm.kernels.options.calibration_on`` decides (``(1, 1)`` is off)."""
        return self.context_temperature, self.context_lse_scale

    @property
    def block_ft(self) -> bool:
        """The ``block-ft`` preset: prompts in the Block-Attention training layout
        (``lazyllm.inputs.prompt_blockft``)."""
        return self.quality == "block-ft"

    @property
    def packets_fit(self) -> bool:
        """Whether this configuration can carry learned chunk packets: it caches chunk KV,
        in the chat template's layout, in one process, and does not escalate to full
        attention (whose prompt has no packet tokens) (``packets="auto"`` takes the shipped
        packet only then; any other packet raises otherwise)."""
        return (self.mode.caches_chunks and not self.block_ft and self.tensor_parallel == 1
                and self.escalate_below == 0)

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of ``LazyLLM`` (``LazyLLM(path, **c.as_kwargs())``
        runs this configuration); shallow, unlike ``dataclasses.asdict``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes) -> EngineConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


# -- the options' documentation, made from the fields -----------------------------------
def _doc_groups() -> list[tuple[list[str], str]]:
    """``(field names, text)`` of each ``OPTION_DOCS`` entry, in the fields' order."""
    key_of = {name: key for key in OPTION_DOCS for name in key.split(", ")}
    keys = list(dict.fromkeys(key_of[f.name] for f in dataclasses.fields(EngineConfig)))
    return [(key.split(", "), OPTION_DOCS[key]) for key in keys]


def options_docstring(indent: str = "    ") -> str:
    """Every engine option as numpy-style parameter entries (``LazyLLM``'s docstring ends
    with them)."""
    out = []
    for names, text in _doc_groups():
        out += textwrap.wrap(f"{', '.join(names)} : {text}", 92, initial_indent=indent,
                             subsequent_indent=indent * 2, break_long_words=False, break_on_hyphens=False)
    return "\n".join(out) + "\n"


def options_markdown() -> str:
    """Every engine option as a markdown table: docs/guide.md's option table."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    rows = ["| option | default | what it does |", "| --- | --- | --- |"]
    for names, text in _doc_groups():
        shown = ", ".join(f"`{defaults[n]!r}`" for n in names)
        rows.append(f"| {', '.join(f'`{n}`' for n in names)} | {shown} | {text.replace('``', '`')} |")
    return "\n".join(rows) + "\n"


def _choice(name: str, v, choices) -> list[str]:
    return [] if v in choices else [f"{name} must be one of {tuple(choices)}, got {v!r}"]


_CACHING = "reuse=" + " or ".join(f"'{m}'" for m in CHUNK_CACHING_MODES) + " (the modes that cache chunks)"


def _problems(c: EngineConfig) -> list[str]:
    """Every bad option of ``c``, each as a sentence naming it."""
    bad = _value_problems(c)
    if bad:  # the combinations are only meaningful between valid values
        return bad
    tp = c.tensor_parallel
    if tp > 1 and c.recompute_ratio > 0:
        bad.append("recompute_ratio is not supported with tensor_parallel yet")
    if c.escalate_below > 0 and (tp > 1 or not c.mode.caches_chunks):
        bad.append(f"escalate_below needs {_CACHING} and no "
                   "tensor_parallel")
    if tp > 1 and c.kv_disk_dir is not None:
        bad.append("kv_disk_dir is not supported with tensor_parallel yet")
    if tp > 1 and calibration_on(*c.calibration):
        bad.append("context calibration is not supported with tensor_parallel yet")
    if c.kv_disk_dir is not None and not c.mode.caches_chunks:
        bad.append(f"kv_disk_dir needs {_CACHING}")
    if c.packets is not None and not (isinstance(c.packets, str) and c.packets == "auto"):
        if not c.mode.caches_chunks:  # full attention has no chunks to carry a packet
            bad.append(f"packets need {_CACHING}, not {c.reuse!r}")
        if c.block_ft or tp > 1:
            bad.append("packets are not supported with quality='block-ft' or tensor_parallel")
        if c.escalate_below > 0:  # an escalated request is answered as full attention, without packet tokens
            bad.append("packets are not supported with escalate_below (an escalated request is answered by full "
                       "attention, whose prompt has no packet tokens)")
    return bad


def _value_problems(c: EngineConfig) -> list[str]:
    bad = _choice("reuse", c.reuse, REUSE_MODES) + _choice("chunk_context", c.chunk_context, CHUNK_CONTEXTS)
    bad += _choice("attention_backend", c.attention_backend, BACKENDS)
    # the built-in names are valid before the engine (which registers them) is imported
    bad += _choice("recompute_selection", c.recompute_selection, (*BUILTIN_SELECTIONS, *selection_names()))
    bad += _choice("quality", c.quality, (None, *PRESETS))
    bad += _device_problems(c.device) + _dtype_problems(c.dtype)
    bad += calibration_problems(*c.calibration, ("context_temperature", "context_lse_scale"))
    p = c.page_size
    if p is not None and (not _is_int(p) or p < 1 or p & (p - 1)):
        bad.append(f"page_size must be a power of two, got {p!r}")
    if not _is_int(c.recompute_first_tokens) or c.recompute_first_tokens < 0:
        bad.append(f"recompute_first_tokens must be an int >= 0, got {c.recompute_first_tokens!r}")
    if not _is_number(c.recompute_ratio) or not 0.0 <= c.recompute_ratio <= 1.0:
        bad.append(f"recompute_ratio must be in [0, 1], got {c.recompute_ratio!r}")
    if not _is_number(c.escalate_below) or not 0.0 <= c.escalate_below <= 1.0:
        bad.append(f"escalate_below must be in [0, 1], got {c.escalate_below!r}")
    if not _is_int(c.escalate_tokens) or not 1 <= c.escalate_tokens <= 64:
        bad.append(f"escalate_tokens must be an int in [1, 64], got {c.escalate_tokens!r}")
    d = c.recompute_selection_depth
    if not _is_number(d) or not 0.0 < d <= 1.0:
        bad.append(f"recompute_selection_depth must be in (0, 1], got {d!r}")
    for name, v in (("kv_cache_bytes", c.kv_cache_bytes), ("kv_disk_bytes", c.kv_disk_bytes),
                    ("max_batch_tokens", c.max_batch_tokens), ("step_token_budget", c.step_token_budget)):
        if (v is not None or name != "kv_cache_bytes") and (not _is_int(v) or v <= 0):
            bad.append(f"{name} must be a positive int, got {v!r}")
    for name, low in (("max_string_length", 1), ("max_array_length", 1), ("max_json_depth", 1)):
        m = getattr(c, name)
        if m is not None and (not _is_int(m) or m < low):
            bad.append(f"{name} must be an int >= {low} or None, got {m!r}")
    if not _is_int(c.tensor_parallel) or c.tensor_parallel < 1:
        bad.append(f"tensor_parallel must be an int >= 1, got {c.tensor_parallel!r}")
    for name in ("trust_remote_code", "progress", "batch_invariant", "warmup", "mixed_steps", "cuda_graphs"):
        if not isinstance(getattr(c, name), bool):
            bad.append(f"{name} must be a bool, got {getattr(c, name)!r}")
    if c.overlap_decode is not None and not isinstance(c.overlap_decode, bool):
        bad.append(f"overlap_decode must be a bool or None, got {c.overlap_decode!r}")
    options = sys.modules.get("lazyllm.kernels.options")  # not imported: no KernelOptions was made
    if c.kernel_options is not None and (options is None or not isinstance(c.kernel_options, options.KernelOptions)):
        bad.append(f"kernel_options must be a lazyllm.KernelOptions, got {type(c.kernel_options).__name__}")
    if c.kv_disk_dir is not None and not isinstance(c.kv_disk_dir, (str, os.PathLike)):
        bad.append(f"kv_disk_dir must be a path, got {type(c.kv_disk_dir).__name__}")
    return bad


def _device_problems(device) -> list[str]:
    if device is None or device == "auto" or _is_torch(device, "device"):
        return []
    if isinstance(device, str) and _DEVICE.fullmatch(device):
        return []
    import torch

    try:
        torch.device(device)
    except (RuntimeError, TypeError) as e:
        return [f"invalid device {device!r}: {e}"]
    return []


def _is_torch(value, kind: str) -> bool:
    """Whether ``value`` is a ``torch.<kind>`` (no torch imported: it cannot be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, getattr(torch, kind))


def _dtype_problems(dtype) -> list[str]:
    if dtype is None or dtype == "auto" or (isinstance(dtype, str) and dtype in DTYPES):
        return []
    if _is_torch(dtype, "dtype"):
        ok = str(dtype).removeprefix("torch.") in DTYPES.values()
        return [] if ok else [f"unsupported dtype {dtype}"]
    return [f"unsupported dtype {dtype!r}; use float32, float16 or bfloat16"]


def warm_skipped(reuse: str, quality: str | None, n_chunks: int) -> dict:
    """``LazyLLM.warm``'s answer where nothing can be warmed, with a warning saying why: a
    caller who warms documents expects later requests to find them cached."""
    import warnings

    preset = f" (quality={quality!r})" if quality else ""
    warnings.warn(f"warm() does nothing with reuse={reuse!r}{preset}: full attention caches no chunks, only a "
                  "request's identical prompt prefix, which the request itself computes", stacklevel=3)
    return {"chunks": n_chunks, "computed_tokens": 0, "cached_tokens": 0}


def resolve_device(device) -> torch.device:
    """The torch device of a ``device`` option (``"auto"``: CUDA when present)."""
    import torch

    bad = _device_problems(device)
    if bad:
        raise InvalidRequestError(bad[0])
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequestError("device='cuda' was asked for but CUDA is not available")
    return d


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    """The torch dtype of a ``dtype`` option on ``device``."""
    import torch

    bad = _dtype_problems(dtype)
    if bad:
        raise InvalidRequestError(bad[0])
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, DTYPES[dtype])


def resolve_page_size(page_size: int | None, device: torch.device, backend: str) -> int:
    """The KV page size of a ``page_size`` option (``None``: 64 tokens for the Triton kernels
    on CUDA, 16 elsewhere)."""
    if page_size is not None:
        return page_size
    return 64 if device.type == "cuda" and backend == "triton" else 16


__all__ = ["EngineConfig", "register_selection", "selection_names", "selection", "options_docstring",
           "options_markdown", "REUSE_MODES", "CHUNK_CONTEXTS", "CHUNK_CACHING_MODES", "BACKENDS"]
