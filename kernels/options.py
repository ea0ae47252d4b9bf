"""``KernelOptions``: the launch choices of the Triton attention kernels that are not part of
the engine's call (loop, launch configuration, split count, the Gluon prefill switch).

Plain Python (no Triton import), so ``lazyllm.kernels`` exports it without importing Triton.
The defaults are what the engine runs; every other value is for benchmarks and tests.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

__all__ = ["KernelOptions", "KeyLoop", "LOOPS", "calibration_on", "calibration_problem", "calibration_problems"]


# -- APE-style context calibration ------------------------------------------------------
# ``(temperature, LSE scale)`` of how queries past the retrieved documents read them: the
# documents' logits divided by the temperature, their log-sum-exp multiplied by the scale.
# Decided and checked here only: the engine's options (``LazyLLM(context_temperature=,
# context_lse_scale=)``), the attention backend, the Triton launcher and the reference ask.
CALIBRATION_OFF = (1.0, 1.0)


def calibration_on(temperature, lse_scale) -> bool:
    """Whether ``(temperature, lse_scale)`` changes anything (``(1, 1)`` is off)."""
    return (temperature, lse_scale) != CALIBRATION_OFF


def calibration_problem(name: str, v) -> list[str]:
    """``[]`` where ``v`` is a valid temperature or LSE scale (a positive finite number), else
    the sentence saying why, naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v < float("inf"):
        return [f"{name} must be a positive finite number, got {v!r}"]
    return []


def calibration_problems(temperature, lse_scale, names=("temperature", "lse_scale")) -> list[str]:
    """A sentence for each value that is not a positive finite number, named by ``names``."""
    return calibration_problem(names[0], temperature) + calibration_problem(names[1], lse_scale)


class KeyLoop(enum.IntEnum):
    """The key-tile loops of the prefill kernel (``prefill._paged_attn_fwd``); the value is
    its ``QROT`` constexpr (the launcher passes ``int(loop)``)."""

    PER_TILE = 0  # rotate every key tile (any page size)
    PER_RUN = 1  # rotate the query once per run of equal deltas: an outer loop per run
    FLAT_RUNS = 2  # the same as one flat loop over the key tiles
    HALVES = 3  # one loop on the query's two rotary halves (fully rotary heads)

    @property
    def rotates_query(self) -> bool:
        """The query-rotating loops, which need a key tile inside one page."""
        return self is not KeyLoop.PER_TILE


# ``KernelOptions.loop``'s names of the loops
LOOPS = {"per_tile": KeyLoop.PER_TILE, "per_run": KeyLoop.PER_RUN, "flat_runs": KeyLoop.FLAT_RUNS,
         "halves": KeyLoop.HALVES}
_SHORT_HALVES = ("off", "auto", 64, 32)

Loop = Literal["per_tile", "per_run", "flat_runs", "halves"]


@dataclass(frozen=True)
class KernelOptions:
    """Launch choices of ``paged_attention_triton`` beyond the engine's arguments.

    Parameters
    ----------
    loop : the prefill kernel's key-tile loop, ``None`` (default) to choose by shape:
        ``"per_tile"`` rotates every key tile (any page size); the query-rotating loops
        need ``page_size >= BLOCK_N`` (a key tile in one page): ``"per_run"`` an outer loop
        per run of equal deltas, ``"flat_runs"`` the same as one flat loop, ``"halves"`` one
        loop on the query's two rotary halves (fully rotary heads). ``"per_run"`` becomes
        ``"flat_runs"`` on the short path (at most 64 query rows per KV head).
    short_halves : the short path (decode, at most 64 query rows per KV head) for head_dim
        128 in 16-bit with a fully rotary head: ``"off"`` (default) the flat float32 loop;
        ``"auto"`` the rotary-halves loop with 64-key tiles below one program per SM and
        32-key tiles from there; ``64`` or ``32`` that loop with that key tile.
    gluon_prefill : let prefill on Hopper run the warp-specialized Gluon kernel where it
        fits and is the faster (needs ``padding_finite``); ``False`` keeps the Triton one.
    prefill_kernel : ``"triton"`` or ``"gluon"`` forces that prefill kernel (``"gluon"``
        needs ``padding_finite`` and raises where it cannot serve the call).
    num_splits : key-range splits per sequence (flash-decoding); default by occupancy.
    config : ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; ``BLOCK_M <= 0`` derives the
        row tile from the query count (the decode kernel ignores it).
    cs_per_page : the key-rotating loop loads the cos/sin table once per page and
        broadcasts it over the page's slots (``True``) or gathers it per slot.
    prefetch : load the next key tile's cos/sin during this one.
    coef_from_delta : the run loops compute each run's cos/sin from its delta and
        ``inv_freq`` instead of loading two table rows; ``None``: compiled kernels yes, the
        interpreter no.
    coef_lookahead : with ``coef_from_delta``, load the next run's delta and end a run ahead.
    shared_decode : a decode step whose requests hold the same pages (hot documents) reads
        each shared page once for all of them (``grouped_attention_triton``, planned by
        ``lazyllm.kernels.grouping.plan_groups``) wherever the engine finds sharing;
        ``False`` keeps the per-request kernel for every step.
    shared_members, shared_pages : queries and pages per work item of that path (the
        kernel's query tile holds ``shared_members`` times the query heads per KV head).
    """

    loop: Loop | None = None
    short_halves: str | int = "off"
    gluon_prefill: bool = True
    prefill_kernel: Literal["triton", "gluon"] | None = None
    num_splits: int | None = None
    config: tuple[int, int, int, int] | None = None
    cs_per_page: bool = True
    prefetch: bool = True
    coef_from_delta: bool | None = None
    coef_lookahead: bool = True
    shared_decode: bool = True
    shared_members: int = 16
    shared_pages: int = 8

    def __post_init__(self):
        if self.loop is not None and self.loop not in LOOPS:
            raise ValueError(f"loop must be None or one of {tuple(LOOPS)}, got {self.loop!r}")
        if self.short_halves not in _SHORT_HALVES:
            raise ValueError(f"short_halves must be one of {_SHORT_HALVES}, got {self.short_halves!r}")
        if self.prefill_kernel not in (None, "triton", "gluon"):
            raise ValueError(f"prefill_kernel must be None, 'triton' or 'gluon', got {self.prefill_kernel!r}")
        if self.config is not None:
            object.__setattr__(self, "config", tuple(self.config))
        for name in ("shared_members", "shared_pages"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
