"""Launch configurations of the attention kernels, chosen on an H200 (bf16, d=128) with
``benchmarks/kernel_bench.py``; the thresholds of the launcher's routing."""
from __future__ import annotations

# prefill, (BLOCK_M, BLOCK_N, num_warps, num_stages) by head_dim: the key-rotating loop
PREFILL_CFG = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 4, 2)}
# the run loop (pages of at least the key tile): the 128x64 tile spills there
PREFILL_CFG_QROT = {128: (64, 64, 4, 3)}
# the loop on the query's rotary halves: 2 stages were faster than 3
PREFILL_CFG_HALVES = {128: (64, 64, 4, 2)}
# the short path (decode, a few queries per sequence): (BLOCK_N, num_warps, num_stages)
DECODE_CFG = {64: (64, 4, 3), 128: (64, 4, 3), 256: (32, 4, 2)}
# decode (one query per sequence) in the flat run loop, pages of at least the key tile:
# (BLOCK_N, num_warps, num_stages). Two warps: more programs in flight per SM, which is
# what a bandwidth-bound loop needs (faster than four at batch 64-128 over pages of 64)
DECODE_CFG_RUNS = {128: (64, 2, 3)}
# with DECODE_CFG_RUNS: key splits until about this many programs per SM, rounded down to
# a power of two (at batch 32, 2 splits were faster than 3 or 4)
DECODE_RUNS_PROGRAMS_PER_SM = 4
# the short path on rotary halves (``KernelOptions.short_halves``): (fewer programs than
# SMs, at least one per SM); opt-in, as it was no clear win over the flat loop in the engine
DECODE_CFG_HALVES = {128: ((64, 4, 3), (32, 4, 3))}
# The Gluon prefill pays a fixed start per program (table scan, barriers, the first
# rotation) and then runs faster than the Triton kernel: it serves a call only when a query
# tile sees about this many keys on average (key slots less half the queries; measured on H200).
GLUON_MIN_KEYS = 3072


def prefill_config(d: int, page_size: int = 0, halves: bool = False):
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of a prefill: the rotary-halves loop's
    (``halves``), else the run loop's where its key tile fits a page of ``page_size`` (``0``:
    the key-rotating loop), else the key-rotating loop's."""
    if halves and d in PREFILL_CFG_HALVES:
        return PREFILL_CFG_HALVES[d]
    qc = PREFILL_CFG_QROT.get(d)
    if qc is not None and page_size >= qc[1]:
        return qc
    return PREFILL_CFG.get(d, PREFILL_CFG[256])
