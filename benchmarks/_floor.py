"""The floor of a serving loop, and where the rest of its wall time went.

A loop cannot finish faster than the model's own work: the tokens it prefilled at the dense
per-token prefill time, plus its decode steps at the time one step takes to read the weights.
Both rates are measured in the same run (``measure_rates``): the per-token time from fresh
chunks prefilled by ``warm()`` (the fastest of three, each from the call to the device's end of
its work), the step time from the weights' bytes over the device's copy bandwidth. ``floor`` compares a
loop's wall time with that, and splits the wall into the engine thread's prefill and decode
steps, the recompute selection, and the rest (host: tokenizing, building requests, planning,
waking callers, Python between steps).

A script imports it as ``benchmarks._floor`` with the repository root on ``sys.path``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from benchmarks._common import text_of_tokens


@dataclass
class Rates:
    """The device's dense prefill time per token and weight-read time per decode step (s)."""

    prefill_token_s: float
    step_s: float

    def line(self) -> str:
        return (f"floor rates: dense prefill {1e6 * self.prefill_token_s:.1f} us/token, weight read "
                f"{1e3 * self.step_s:.2f} ms/step")


def _bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Copy bandwidth of ``device`` (bytes read plus written per second), median of 5."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        y.copy_(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return 2 * nbytes / times[len(times) // 2]


def weight_bytes(hf) -> int:
    """Bytes a decode step reads: every parameter but an untied input embedding (one row is
    read per token)."""
    emb = hf.get_input_embeddings().weight
    out = hf.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == emb.data_ptr()
    total = sum(p.numel() * p.element_size() for p in hf.parameters())
    return total if tied else total - emb.numel() * emb.element_size()


def measure_rates(llm, tokens: int = 1024, seed: int = 12345, samples: int = 3) -> Rates:
    """``Rates`` of ``llm``'s engine: fresh chunks of about ``tokens`` tokens prefilled alone
    (after one of the same size, so that kernels are compiled), each timed from the call to
    the device's end of its work (``warm`` returns once the engine has launched it; the
    engine's own ``prefill_s`` is host time, which can end before the device's work does); the
    fastest of ``samples``; and the weights' read time."""
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    m = llm.engine.metrics
    llm.warm([text_of_tokens(llm, tokens, seed)])
    best = float("inf")
    for i in range(samples):
        text = text_of_tokens(llm, tokens, seed + 1 + i)
        t0 = m["prefill_tokens"]
        sync()
        start = time.perf_counter()
        llm.warm([text])
        sync()
        best = min(best, (time.perf_counter() - start) / max(m["prefill_tokens"] - t0, 1))
    return Rates(best, weight_bytes(llm.hf_model) / _bandwidth(llm.device))


def floor(rates: Rates, m0, m1, wall_s: float) -> dict:
    """The floor of a loop that ran ``wall_s`` seconds between the engine counters ``m0`` and
    ``m1`` (mappings of ``EngineMetrics``), its fraction of the wall, and the wall split into
    prefill, decode, selection and host seconds."""
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in ("prefill_tokens", "decode_steps", "prefill_s", "decode_s",
                                                  "selection_s")}
    floor_s = d["prefill_tokens"] * rates.prefill_token_s + d["decode_steps"] * rates.step_s
    host = wall_s - d["prefill_s"] - d["decode_s"]
    return dict(floor_s=floor_s, of_floor=floor_s / wall_s if wall_s > 0 else float("nan"), wall_s=wall_s,
                prefill_s=d["prefill_s"], decode_s=d["decode_s"], selection_s=d["selection_s"], host_s=host,
                prefill_tokens=d["prefill_tokens"], decode_steps=d["decode_steps"])


def floor_line(f: dict) -> str:
    """One printed line of ``floor``'s figures."""
    return (f"floor {f['floor_s']:.3f} s ({f['prefill_tokens']} prefilled tokens, {f['decode_steps']} decode "
            f"steps): the loop ran at {100 * f['of_floor']:.0f}% of it; wall {f['wall_s']:.3f} s = prefill "
            f"{f['prefill_s']:.3f} + decode {f['decode_s']:.3f} + host {f['host_s']:.3f} s "
            f"(selection inside prefill: {f['selection_s']:.3f} s)")


__all__ = ["Rates", "floor", "floor_line", "measure_rates", "weight_bytes"]
