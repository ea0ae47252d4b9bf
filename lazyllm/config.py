"""``EngineConfig``: every engine option of ``LazyLLM``, validated once.

The options are declared in ``lazyllm.options`` (``EngineOptions``: one field each, with its
type, default, bounds or choices and doc); ``EngineConfig`` is that class validated: each
option against its declaration (``lazyllm.option_spec.field_problems``), then the rules
between options (``_problems``), every bad option named in one ``InvalidRequestError``.

``LazyLLM(...)`` builds one from its keyword arguments (``EngineConfig.resolve``: a quality
preset first, then the options passed explicitly) and hands it to the engine, the KV planner,
recovery and the attention backend, which trust it. ``llm.config`` is the running
configuration, with the values chosen at load time (device, dtype, page size, pool bytes,
backend) filled in.

Light to import (no torch: the module imports it where a device or dtype is resolved), so a
command line checks its flags before it pays for torch and transformers.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import InvalidRequestError
from .kernels.options import calibration_on
from .option_spec import field_problems, normalized
from .option_spec import options_docstring as _docstring
from .option_spec import options_markdown as _markdown
from .options import (
    BACKENDS,
    CHUNK_CONTEXTS,
    DEFAULT_MAX_ARRAY_LENGTH,
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_MAX_STRING_LENGTH,
    DTYPES,
    EngineOptions,
    device_problems,
    dtype_problems,
)
from .presets import PRESETS, QUALITY_OPTIONS
from .reuse_modes import CHUNK_CACHING_MODES, MODES, REUSE_MODES, ReuseMode
from .selections import BUILTIN_SELECTIONS, register_selection, selection, selection_names

log = logging.getLogger("lazyllm")

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EngineConfig(EngineOptions):
    """The engine options of ``LazyLLM`` (declared in ``lazyllm.options``; see ``LazyLLM``'s
    docstring for each in full). Validated when made: every bad option is named in one
    ``InvalidRequestError``. ``None`` for ``dtype``, ``kv_cache_bytes``, ``page_size`` and
    ``overlap_decode`` means "chosen at load time" (the running ``llm.config`` holds the value
    chosen). Make one with a preset through ``resolve``; made directly, every value is taken
    as given."""

    def __post_init__(self):
        bad = _problems(self)
        if bad:
            raise InvalidRequestError("; ".join(bad))
        # numbers in one type, whatever the caller passed (``1`` and ``1.0`` the same config)
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, normalized(f, getattr(self, f.name)))

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
    def packets_fit(self) -> bool:
        """Whether this configuration can carry learned chunk packets: it caches chunk KV,
        in the chat template's layout, in one process, and does not escalate to full
        attention (whose prompt has no packet tokens) (``packets="auto"`` takes the shipped
        packet only then; any other packet raises otherwise)."""
        return (self.mode.caches_chunks and self.prompt_layout == "chat" and self.tensor_parallel == 1
                and self.escalate_below == 0)

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments of ``LazyLLM`` (``LazyLLM(path, **c.as_kwargs())``
        runs this configuration); shallow, unlike ``dataclasses.asdict``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes) -> EngineConfig:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def options_docstring(indent: str = "    ") -> str:
    """Every engine option as numpy-style parameter entries (``LazyLLM``'s docstring ends
    with them)."""
    return _docstring(EngineConfig, indent)


def options_markdown() -> str:
    """Every engine option as a markdown table: docs/guide.md's option table."""
    return _markdown(EngineConfig)


_CACHING = "reuse=" + " or ".join(f"'{m}'" for m in CHUNK_CACHING_MODES) + " (the modes that cache chunks)"


def _problems(c: EngineConfig) -> list[str]:
    """Every bad option of ``c``, each as a sentence naming it: each option against its
    declaration, then the rules between options."""
    bad = [p for f in dataclasses.fields(c) for p in field_problems(f, getattr(c, f.name))]
    if bad:  # the combinations are only meaningful between valid values
        return bad
    tp = c.tensor_parallel
    if tp > 1 and c.recompute_ratio > 0:
        bad.append("recompute_ratio is not supported with tensor_parallel yet")
    if c.escalate_below > 0 and (tp > 1 or not c.mode.caches_chunks):
        bad.append(f"escalate_below needs {_CACHING} and no tensor_parallel")
    if tp > 1 and c.kv_disk_dir is not None:
        bad.append("kv_disk_dir is not supported with tensor_parallel yet")
    if tp > 1 and calibration_on(*c.calibration):
        bad.append("context calibration is not supported with tensor_parallel yet")
    if c.kv_disk_dir is not None and not c.mode.caches_chunks:
        bad.append(f"kv_disk_dir needs {_CACHING}")
    if c.packets is not None and not (isinstance(c.packets, str) and c.packets == "auto"):
        if not c.mode.caches_chunks:  # full attention has no chunks to carry a packet
            bad.append(f"packets need {_CACHING}, not {c.reuse!r}")
        if c.prompt_layout != "chat" or tp > 1:
            bad.append(f"packets are not supported with prompt_layout={c.prompt_layout!r} (quality='block-ft') "
                       "or tensor_parallel")
        if c.escalate_below > 0:  # an escalated request is answered as full attention, without packet tokens
            bad.append("packets are not supported with escalate_below (an escalated request is answered by full "
                       "attention, whose prompt has no packet tokens)")
    return bad


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

    bad = device_problems("device", device)
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

    bad = dtype_problems("dtype", dtype)
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
           "options_markdown", "REUSE_MODES", "CHUNK_CONTEXTS", "CHUNK_CACHING_MODES", "BACKENDS", "DTYPES",
           "BUILTIN_SELECTIONS", "DEFAULT_MAX_STRING_LENGTH", "DEFAULT_MAX_ARRAY_LENGTH", "DEFAULT_MAX_JSON_DEPTH",
           "QUALITY_OPTIONS", "PRESETS"]
