"""``paged_attention_triton``: validate the call, plan the launch, run the kernel.

The plan (``LaunchPlan``, frozen) holds every choice the launcher makes from the shapes and
``KernelOptions``: which kernel (the Triton prefill kernel and its key-tile loop, the decode
kernel for pages smaller than the key tile, or the Gluon prefill on Hopper), the tile sizes,
the key splits. ``_launch_triton`` then only prepares tensors and launches.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

import torch

import triton
from lazyllm.intmath import next_pow2

from ..options import LOOPS, KernelOptions, KeyLoop, calibration_on, calibration_problems
from ._common import _LOG2E, _interpreting
from .configs import DECODE_CFG as _DECODE_CFG
from .configs import DECODE_CFG_HALVES as _DECODE_CFG_HALVES
from .configs import DECODE_CFG_RUNS as _DECODE_CFG_RUNS
from .configs import DECODE_RUNS_PROGRAMS_PER_SM as _DECODE_RUNS_PER_SM
from .configs import GLUON_MIN_KEYS as _GLUON_MIN_KEYS
from .configs import PREFILL_CFG_HALVES as _PREFILL_CFG_HALVES
from .configs import prefill_config as _prefill_config
from .decode import _merge_splits, _paged_decode_fwd
from .prefill import _paged_attn_fwd
from .rope import delta_runs, rope_table

__all__ = ["paged_attention_triton", "LaunchPlan", "specialization", "launch_variants"]

_DEFAULT_OPTIONS = KernelOptions()
_NUM_SMS: dict = {}
_QROT_FAILED: set = set()  # shapes whose query-rotating loop did not compile
_GLUON_FAILED: set = set()  # shapes whose Gluon prefill failed (served by the Triton prefill)
_GLUON_MODULE: list = []  # [gluon_prefill], or [None] in a Triton without Gluon, once tried


def _gluon_module():
    """This package's ``gluon_prefill``, or ``None`` where this Triton has no Gluon; the
    import is tried once (the launcher asks on every prefill call)."""
    if not _GLUON_MODULE:
        try:
            from . import gluon_prefill
        except Exception:  # noqa: BLE001  (a Triton without Gluon)
            gluon_prefill = None
        _GLUON_MODULE.append(gluon_prefill)
    return _GLUON_MODULE[0]


def _gluon_supported(q, k_cache, v_cache, block_table, inv_freq) -> bool:
    """``gluon_prefill.supported`` where Gluon imports (Hopper only; never on CPU)."""
    if not q.is_cuda:
        return False
    gp = _gluon_module()
    return gp is not None and gp.supported(q, k_cache, v_cache, block_table, inv_freq)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


@dataclass(frozen=True)
class LaunchPlan:
    """Every launch choice of one ``paged_attention_triton`` call (no tensors).

    ``loop`` is the prefill kernel's key-tile loop (``KeyLoop``); ``decode_kernel``: the
    per-page decode kernel runs instead; ``gluon``: the Gluon prefill serves the call (the
    Triton fields then describe the fallback); ``config``: the configuration asked for (or
    the batch-invariant one), kept for the key-rotating fallback; ``window``: a sliding
    window (never the Gluon prefill); ``ape``: APE-style context calibration (never the
    Gluon prefill; ``num_splits`` then counts the splits of each of the two key classes)."""

    loop: KeyLoop
    decode_kernel: bool
    short: bool
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    ppt: int
    q_tiles: int
    num_splits: int
    cs_per_page: bool
    prefetch: bool
    from_delta: bool
    lookahead: bool
    packed_rot: bool
    gluon: bool
    gluon_key: tuple
    loop_key: tuple
    config: tuple | None
    window: int = 0  # a sliding window (the kernels' WINDOW constexpr); 0: none
    ape: bool = False  # APE-style context calibration (the kernels' APE constexpr)


# fields of a plan that select no compiled kernel: a grid size, the split count (its class
# is in the key instead), and the cache keys and requested configuration the others derive from
_NOT_COMPILED = frozenset({"q_tiles", "num_splits", "gluon_key", "loop_key", "config"})


def _int_class(n: int) -> int:
    """Triton's specialization of an integer argument: 1, a multiple of 16, or neither."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def specialization(plan: LaunchPlan, width: int, row_stride: int, plane: int) -> tuple:
    """What Triton compiles for a launch of ``plan`` over page tables ``width`` entries wide
    with rows ``row_stride`` apart and their four planes (page, position, delta, length)
    ``plane`` entries apart: every field of the plan that is a constexpr (a field added to
    ``LaunchPlan`` counts unless listed in ``_NOT_COMPILED``), and the specialization
    classes of the integer arguments (split count, width, row stride, the split merge's
    power-of-two bound) and of the planes' alignment. Two launches with the same key run
    the same compiled kernels."""
    chosen = tuple(getattr(plan, f.name) for f in fields(plan) if f.name not in _NOT_COMPILED)
    parts = plan.num_splits * (plan.ppt if plan.decode_kernel else 1) * (2 if plan.ape else 1)
    return chosen + (_int_class(plan.num_splits), _int_class(width), _int_class(row_stride),
                     next_pow2(parts, 2) if parts > 1 else 0, plane % 4 == 0, plane % 2 == 0)


def launch_variants(model, k_cache, v_cache, batch: int, max_seqlen_q: int, width: int, row_stride: int,
                    plane: int | None = None) -> frozenset:
    """The launcher's variants for one attention launch shape: the ``specialization`` of the
    ``LaunchPlan`` that ``plan_launch`` (the function each launch calls) makes, for every layer
    kind (sliding window, RoPE table) of ``model`` (a ``LlamaFamilyModel``) over the caches of
    one layer. The page, position, delta and length tables are the planes of one int32 tensor,
    ``plane`` entries apart (default ``batch * width``, an eager step's packed tables). Two
    shapes with the same variants run the same compiled kernels."""
    plane = batch * width if plane is None else plane
    att, spec = model.attention, model.spec
    q = torch.empty((1, spec.num_heads, spec.head_dim), device=k_cache.device, dtype=k_cache.dtype)
    table = torch.zeros((batch, width), dtype=torch.int32, device=k_cache.device)
    opts = att.options or KernelOptions()
    keys = set()
    for window, fi in sorted({(w or 0, fi) for w, fi in zip(model.windows, model.freq_index)}):
        inv = model.inv_freqs[fi]
        p = plan_launch(q, k_cache[0], v_cache[0], table, inv, batch, max_seqlen_q, inv.numel() > 0,
                        att.batch_invariant, att.padding_finite, opts, window, att.calibrated)
        keys.add(specialization(p, width, row_stride, plane))
    return frozenset(keys)


def _validate(q, k_cache, v_cache, inv_freq) -> None:
    total_q, hq, d = q.shape
    _, page_size, hkv, dk = k_cache.shape
    if dk != d or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"cache shapes {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if d & (d - 1) or d < 16:
        raise ValueError(f"head_dim {d} must be a power of two >= 16")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size {page_size} must be a power of two")
    half = int(inv_freq.numel())
    if 2 * half > d:
        raise ValueError(f"rotary_dim {2 * half} exceeds head_dim {d}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache need a contiguous last dim")


def plan_launch(q, k_cache, v_cache, block_table, inv_freq, batch: int, max_seqlen_q: int, use_rope: bool,
                batch_invariant: bool, padding_finite: bool, opts: KernelOptions, window: int = 0,
                ape: bool = False) -> LaunchPlan:
    """The launch choices for a validated call with ``batch`` sequences (``use_rope``: RoPE
    on and a rotary part; ``window``: a sliding window, 0 for none; ``ape``: APE-style context
    calibration)."""
    _, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    half = int(inv_freq.numel())
    group = hq // hkv
    max_blocks = block_table.shape[1]
    config, num_splits = opts.config, opts.num_splits
    loop = None if opts.loop is None else LOOPS[opts.loop]
    if batch_invariant:
        bn = 64 if d <= 128 else 32
        config, num_splits = (64, bn, 4, 2), 1
        loop = KeyLoop.FLAT_RUNS if page_size >= bn else KeyLoop.PER_TILE
    rows = max_seqlen_q * group
    one_query = max_seqlen_q == 1 and not batch_invariant
    short = rows <= 64  # a few queries per sequence: small query tiles, no causal scan
    # the one-loop kernel on rotary halves needs a fully rotary head when it rotates
    halves_ok = (not use_rope or 2 * half == d) and d >= 32
    half16 = halves_ok and k_cache.dtype in (torch.float16, torch.bfloat16)
    short_halves = (short and config is None and half16 and d in _DECODE_CFG_HALVES
                    and opts.short_halves != "off")
    if short_halves:  # one query tile per sequence and KV head: batch * hkv programs before split-K
        short_cfg = next((c for c in _DECODE_CFG_HALVES[d] if c[0] == opts.short_halves),
                         _DECODE_CFG_HALVES[d][int(batch * hkv >= _num_sms(q.device))])
    else:
        short_cfg = _DECODE_CFG.get(d, _DECODE_CFG[256])
    dec_n = config[1] if config is not None else short_cfg[0]
    qkey = (d, k_cache.dtype, short, page_size, config)
    if loop is None:
        halves = short_halves if short else (half16 and d in _PREFILL_CFG_HALVES)
        n_needed = dec_n if short else (config[1] if config is not None else _prefill_config(
            d, page_size, halves)[1])
        loop = (KeyLoop.HALVES if halves else KeyLoop.PER_RUN) if page_size >= n_needed else KeyLoop.PER_TILE
        loop = loop if qkey not in _QROT_FAILED else KeyLoop.PER_TILE
    if loop is KeyLoop.HALVES and not halves_ok:
        raise ValueError(f"loop='halves' needs a fully rotary head (rotary_dim {2 * half} != head_dim {d})")
    if loop is KeyLoop.PER_RUN and short:
        # the flat loop made decode faster and its RoPE cost lower, while for prefill the
        # loop per run was faster (measured on H200)
        loop = KeyLoop.FLAT_RUNS
    # decode with pages smaller than the key tile: query rotated per page (_paged_decode_fwd);
    # with a tile inside one page the general kernel's run loop serves decode too
    decode_kernel = one_query and not loop.rotates_query
    # decode in the flat run loop (pages of at least the key tile: the engine's CUDA case),
    # from about a quarter of the SMs' worth of (sequence, KV head) programs: below that the
    # call is latency-bound and four warps a program were faster (batch 1, H200)
    runs_decode = (one_query and loop is KeyLoop.FLAT_RUNS and config is None and d in _DECODE_CFG_RUNS
                   and 4 * batch * hkv >= _num_sms(q.device))
    ppt = 1
    if decode_kernel:
        block_n, num_warps, num_stages = _DECODE_CFG.get(d, _DECODE_CFG[256])
        if config is not None:
            _, block_n, num_warps, num_stages = config
        ppt = max(1, block_n // page_size)
        block_m = max(16, next_pow2(ppt * group))
    elif config is not None:
        block_m, block_n, num_warps, num_stages = config
        if block_m <= 0:  # a decode config (the tile of rows is derived)
            block_m = max(16, next_pow2(rows))
    elif short:
        block_m = max(16, next_pow2(rows))
        if runs_decode:
            block_n, num_warps, num_stages = _DECODE_CFG_RUNS[d]
        else:
            cfg = short_cfg if loop is KeyLoop.HALVES else _DECODE_CFG.get(d, _DECODE_CFG[256])
            block_n, num_warps, num_stages = cfg
    else:
        block_m, block_n, num_warps, num_stages = _prefill_config(d, page_size if loop.rotates_query else 0,
                                                                       loop is KeyLoop.HALVES)
    if _interpreting():
        num_stages = 1
    if loop.rotates_query and page_size < block_n:
        raise ValueError(f"a query-rotating loop needs page_size >= BLOCK_N, got {page_size} < {block_n}")
    q_tiles = 1 if decode_kernel else triton.cdiv(rows, block_m)
    kv_tiles = triton.cdiv(max_blocks * page_size, block_n)
    if window:  # the kernels visit only the tiles a window reaches: split those
        kv_tiles = min(kv_tiles, triton.cdiv(window + max_seqlen_q, block_n) + 1)
    if num_splits is None:
        # about one program per SM at least; split-K only while there are fewer
        ctas = q_tiles * batch * hkv
        sms = _num_sms(q.device)
        num_splits = 1
        if runs_decode:
            # a bandwidth-bound loop of small programs: about DECODE_RUNS_PROGRAMS_PER_SM per
            # SM, the split count a power of two, at least two key tiles per split
            want = (_DECODE_RUNS_PER_SM * sms) // ctas
            num_splits = max(1, min(1 << max(0, want.bit_length() - 1), kv_tiles // 2, 64))
        elif one_query and ctas < sms:
            # decode at small batch is latency-bound: about two programs per SM, at least two
            # key tiles each (faster than one program per SM, measured on H200)
            num_splits = max(1, min(triton.cdiv(2 * sms, ctas), kv_tiles // 2, 64))
        elif ctas < sms:
            # a few queries per sequence (prefill of 64 tokens, say): about two programs per
            # SM, which these kernels' registers and shared memory allow
            num_splits = max(1, min((2 * sms) // ctas, kv_tiles // 4, 64))
        # from one program per SM on, no split-K: two programs fit on an SM at once, and one
        # split was faster than two (measured on H200)
    num_splits = max(1, min(int(num_splits), kv_tiles))

    gkey = (d, k_cache.dtype, page_size)
    forced = opts.prefill_kernel == "gluon"
    if forced and window:
        raise ValueError("the Gluon prefill has no sliding window (prefill_kernel='gluon' with window=)")
    if forced and ape:
        raise ValueError("the Gluon prefill has no context calibration (prefill_kernel='gluon' with ctx_range=)")
    gluon = forced or (
        opts.prefill_kernel is None and padding_finite and not short and loop is KeyLoop.HALVES and opts.loop is None
        and num_splits == 1 and config is None and not batch_invariant and not _interpreting()
        and max_blocks * page_size - max_seqlen_q // 2 >= _GLUON_MIN_KEYS
        and gkey not in _GLUON_FAILED and opts.gluon_prefill
        and _gluon_supported(q, k_cache, v_cache, block_table, inv_freq) and not window and not ape)

    coef_from_delta = opts.coef_from_delta
    if coef_from_delta is None:
        coef_from_delta = not _interpreting()
    from_delta = bool(use_rope and loop.rotates_query and coef_from_delta)
    # with APE the rotary-halves loop jumps over key tiles, where a run ahead is not the next
    lookahead = bool(from_delta and opts.coef_lookahead and not (ape and loop is KeyLoop.HALVES))
    packed_rot = loop is KeyLoop.HALVES and not _interpreting() and k_cache.dtype in (torch.float16, torch.bfloat16)
    return LaunchPlan(
        loop=loop, decode_kernel=decode_kernel, short=short, block_m=block_m, block_n=block_n,
        num_warps=num_warps, num_stages=num_stages, ppt=ppt, q_tiles=q_tiles, num_splits=num_splits,
        cs_per_page=opts.cs_per_page, prefetch=opts.prefetch, from_delta=from_delta, lookahead=lookahead,
        packed_rot=packed_rot, gluon=gluon, gluon_key=gkey, loop_key=qkey, config=config, window=int(window),
        ape=bool(ape),
    )


def paged_attention_triton(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    block_pos: torch.Tensor,
    block_delta: torch.Tensor,
    block_len: torch.Tensor,
    inv_freq: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    use_rope: bool = True,
    rope: tuple[torch.Tensor, ...] | None = None,
    batch_invariant: bool = False,
    padding_finite: bool = False,
    options: KernelOptions | None = None,
    window: int | None = None,
    ctx_range: torch.Tensor | None = None,
    ctx_temperature: float = 1.0,
    ctx_lse_scale: float = 1.0,
) -> torch.Tensor:
    """Deferred-RoPE attention of a varlen batch of queries over paged KV (Triton).

    Same function as ``reference.paged_attention_ref``; serves prefill and decode.

    Parameters
    ----------
    q : ``(total_q, num_q_heads, head_dim)``, RoPE already applied at ``q_pos``.
    q_pos : ``(total_q,)`` int.
    cu_seqlens_q : ``(batch + 1,)`` int.
    k_cache, v_cache : ``(num_pages, page_size, num_kv_heads, head_dim)``, last dim
        contiguous; float16, bfloat16 or float32. ``page_size`` a power of two.
    block_table, block_pos, block_delta, block_len : ``(batch, max_blocks)`` int; entries
        with ``block_len == 0`` are padding and never read.
    inv_freq : ``(rotary_dim // 2,)`` float32, ``rotary_dim <= head_dim``.
    sm_scale : softmax scale.
    out : optional ``(total_q, num_q_heads, head_dim)`` output buffer.
    max_seqlen_q : the longest query count of a sequence. Pass it: without it the
        launcher reads ``cu_seqlens_q`` on the host (a device sync, no CUDA graphs).
        1 (or a few rows per KV head) selects the decode path.
    use_rope : ``False`` ignores ``block_delta`` (no rotation in the kernel): for batches
        whose deltas are all 0, models without RoPE, and measuring the rotation's cost.
    rope : optional ``rope_table(block_delta, inv_freq)``, to build it once per step
        (a ``(cos, sin)`` pair is accepted too: the runs are then derived here).
    batch_invariant : one launch configuration for every call, prefill or decode, whatever
        the batch: the general kernel, 64-row query tiles, a fixed key tile, no split-K.
        A query row then sees its keys in the same tiles, in the same order, through the same
        instructions, so its output does not depend on the other rows of the batch, nor on
        whether it is decoded or prefilled (slower for decode; for reproducible serving).
    padding_finite : the caller vouches that every slot of every page the table names holds
        finite values, padding slots included (the engine's pool is zero-initialized and only
        written with K/V). On a Hopper GPU this lets prefill run the warp-specialized Gluon
        kernel (``gluon_prefill``), which reads whole pages by TMA, where it fits
        (``gluon_prefill.supported``; the rotary-halves prefill with one key split and more
        than 64 query rows per KV head: never decode, whose rows would fill 4 of its 128) and
        where it is the faster: long key ranges (``configs.GLUON_MIN_KEYS``).
    options : ``KernelOptions`` (loop, launch configuration, splits, Gluon switch); the
        default is what the engine runs.
    window : sliding window (Gemma 3's local layers, Mistral): a query at ``p`` sees keys at
        ``p - window < pos <= p``, as ``reference.paged_attention_ref(..., window=)``. The
        kernels skip the key tiles no query's window reaches and mask the rest; each window
        size is a compiled variant (``WINDOW`` constexpr). Never the Gluon prefill.
        ``None``: no window (the launch is exactly the one without the argument).
    ctx_range, ctx_temperature, ctx_lse_scale : APE-style calibration of how queries past
        the retrieved documents read them, as ``reference.paged_attention_ref`` defines it:
        ``ctx_range`` ``(batch, 2)`` int (on ``q``'s device; int32 contiguous avoids a copy)
        gives each sequence's context key positions ``[start, end)`` (``start == end``: none);
        for a query at position ``>= end`` the context keys' logits are divided by
        ``ctx_temperature`` (``> 0``) and the context's log-sum-exp is multiplied by
        ``ctx_lse_scale``. Queries before ``end`` are unchanged; the cached KV is not touched.
        Off (the launch is exactly the one without the arguments) when ``ctx_range`` is
        ``None`` or both floats are 1. On, the kernels keep the context keys and the other
        keys in two softmax states, computed by separate programs (twice the key splits,
        each class visiting only the key tiles it needs) and combined by the split merge,
        which applies the scale to the context's log-sum-exp merged over all its splits.
        Never the Gluon prefill (``prefill_kernel='gluon'`` raises); the temperature and
        scale are compile-time free (no recompilation per value).

    Returns
    -------
    ``out``, ``(total_q, num_q_heads, head_dim)`` in ``q.dtype``; 0 for a query that sees
    no key.
    """
    opts = _DEFAULT_OPTIONS if options is None else options
    _validate(q, k_cache, v_cache, inv_freq)
    if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    window = 0 if window is None else int(window)
    ape = ctx_range is not None and calibration_on(ctx_temperature, ctx_lse_scale)
    if ape:
        bad = calibration_problems(ctx_temperature, ctx_lse_scale, ("ctx_temperature", "ctx_lse_scale"))
        if bad:
            raise ValueError("; ".join(bad))
        t, sc = float(ctx_temperature), float(ctx_lse_scale)
        n_seq = cu_seqlens_q.numel() - 1
        if ctx_range.dim() != 2 or ctx_range.shape[1] != 2 or ctx_range.shape[0] != n_seq:
            raise ValueError(f"ctx_range must be ({n_seq}, 2), got {tuple(ctx_range.shape)}")
        if ctx_range.dtype.is_floating_point or ctx_range.dtype == torch.bool:
            raise ValueError(f"ctx_range must hold integers, got {ctx_range.dtype}")
        ctx_range = ctx_range.to(device=q.device, dtype=torch.int32).contiguous()
        ape_args = (ctx_range, 1.0 / t, sc)
    else:
        ape_args = None
    if out is None:
        out = torch.empty_like(q)
    total_q = q.shape[0]
    batch = cu_seqlens_q.numel() - 1
    if total_q == 0 or batch <= 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if max_seqlen_q <= 0:
        return out
    use_rope = bool(use_rope) and int(inv_freq.numel()) > 0
    plan = plan_launch(q, k_cache, v_cache, block_table, inv_freq, batch, max_seqlen_q, use_rope,
                       batch_invariant, padding_finite, opts, window, ape)
    args = (q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, block_pos, block_delta, block_len,
            inv_freq, sm_scale, out)
    if plan.gluon:
        res = _launch_gluon(plan, args, max_seqlen_q, use_rope, rope, padding_finite, opts)
        if res is not None:
            return res
    return _launch_triton(plan, args, max_seqlen_q, use_rope, rope, batch_invariant, ape_args)


def _launch_gluon(plan: LaunchPlan, args, max_seqlen_q, use_rope, rope, padding_finite, opts):
    """The Gluon prefill's output; ``None`` where it failed and the Triton prefill should
    serve the call (and this shape from now on)."""
    forced = opts.prefill_kernel == "gluon"
    try:
        gluon_prefill = _gluon_module()
        if gluon_prefill is None:  # only when forced: the routing asked already
            raise RuntimeError("prefill_kernel='gluon' needs a Triton with Gluon (triton.experimental.gluon)")
        return gluon_prefill.paged_prefill_gluon(
            *args, max_seqlen_q=max_seqlen_q, padding_finite=padding_finite,
            use_rope=use_rope, runs=rope[2] if use_rope and rope is not None and len(rope) > 2 else None)
    except Exception as e:  # noqa: BLE001
        if forced or torch.cuda.is_current_stream_capturing():
            raise
        # a Gluon build or launch failure (another Triton version, say): serve this shape
        # with the Triton prefill from now on, which computes the same function
        _GLUON_FAILED.add(plan.gluon_key)
        d, dtype, page_size = plan.gluon_key
        warnings.warn(f"Gluon prefill failed for head_dim={d}, {dtype}, pages of {page_size} "
                      f"({type(e).__name__}: {e}); using the Triton prefill", RuntimeWarning, stacklevel=3)
        return None


def _launch_triton(plan: LaunchPlan, args, max_seqlen_q, use_rope, rope, batch_invariant, ape_args=None):
    """Prepare the tables and launch the prefill or decode kernel (and the split merge).
    ``ape_args``: ``(ctx_range int32, 1 / temperature, lse scale)`` with ``plan.ape``."""
    (q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, block_pos, block_delta, block_len,
     inv_freq, sm_scale, out) = args
    total_q, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    batch = cu_seqlens_q.numel() - 1
    max_blocks = block_table.shape[1]
    half = int(inv_freq.numel())
    pass_dim = d - 2 * half
    group = hq // hkv
    loop, num_splits = plan.loop, plan.num_splits
    target = out if out.stride(-1) == 1 else torch.empty_like(q)

    rope_arg = rope
    if plan.from_delta:  # the kernel reads the deltas and inv_freq, not the cos/sin table
        inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
        if block_delta.stride(-1) != 1:
            block_delta = block_delta.contiguous()
        if rope is None:
            rope = (inv_freq, inv_freq, delta_runs(block_delta))  # cos/sin never read
    runs = inv_freq  # never read unless the loop rotates the query
    if use_rope:
        if rope is None:
            rope = rope_table(block_delta, inv_freq.to(q.device))
        cos, sin = rope[0], rope[1]
        if not plan.from_delta and (cos.shape != (batch, max_blocks, half)
                                    or not (cos.is_contiguous() and sin.is_contiguous())):
            raise ValueError(f"rope table of shape {tuple(cos.shape)}, expected {(batch, max_blocks, half)} contiguous")
        if loop.rotates_query:
            runs = rope[2] if len(rope) > 2 else delta_runs(block_delta)
            if runs.shape != (batch, max_blocks) or not runs.is_contiguous():
                raise ValueError(f"runs table of shape {tuple(runs.shape)}, expected {(batch, max_blocks)} contiguous")
    else:
        cos = sin = inv_freq  # never read
        if loop in (KeyLoop.PER_RUN, KeyLoop.FLAT_RUNS):  # one run per row: no rotation at all
            runs = torch.full((1,), max_blocks, dtype=torch.int32, device=q.device).expand(batch, max_blocks)
            runs = runs.contiguous()
    n_parts = num_splits * (plan.ppt if plan.decode_kernel else 1)
    ape = {}  # absent: the kernels' code without context calibration
    if plan.ape:  # two key classes: twice the splits, always merged
        num_splits, n_parts = 2 * num_splits, 2 * n_parts
        ape = dict(APE=True, CtxRange=ape_args[0], ctx_inv_t=ape_args[1])
    if n_parts > 1:
        part_o = torch.empty((total_q, hq, n_parts, d), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((total_q, hq, n_parts), device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = target  # never read

    dot_prec = "ieee" if k_cache.dtype == torch.float32 else "tf32"
    win = dict(WINDOW=plan.window) if plan.window else {}  # absent: the kernels' code without a window
    idx64 = max(k_cache.numel(), v_cache.numel()) >= 2**31  # element offsets fit in int32 otherwise
    common = (
        float(sm_scale) * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
    )
    tables = (block_table.stride(0), block_pos.stride(0), block_len.stride(0), max_blocks, num_splits)
    block_m, block_n = plan.block_m, plan.block_n
    if plan.decode_kernel:
        _paged_decode_fwd[(hkv * num_splits, batch)](
            q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, block_pos, block_len, cos, sin,
            target, part_o, part_lse, *common, target.stride(0), target.stride(1), *tables,
            NUM_Q_HEADS=hq, G=group, HEAD_DIM=d, HALF=half, ROT=2 * half, PAGE_SIZE=page_size,
            PPT=plan.ppt, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_OUT=n_parts > 1, USE_ROPE=use_rope,
            DOT_PREC=dot_prec, IDX64=idx64, PREFETCH=plan.prefetch and not plan.ape,
            num_warps=plan.num_warps, num_stages=plan.num_stages, **win, **ape,
        )
    else:
        half_p = max(16, next_pow2(half)) if half else 16
        pass_p = max(16, next_pow2(pass_dim)) if pass_dim else 16
        try:
            _paged_attn_fwd[(plan.q_tiles, hkv * num_splits, batch)](
                q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, block_pos, block_len, cos, sin, runs,
                block_delta, inv_freq, target, part_o, part_lse, *common, target.stride(0), target.stride(1),
                *tables[:3], block_delta.stride(0), *tables[3:],
                NUM_Q_HEADS=hq, G=group, HEAD_DIM=d, HALF=half, HALF_P=half_p,
                PASS=pass_dim, PASS_P=pass_p, PAGE_SIZE=page_size,
                BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_OUT=num_splits > 1,
                SCAN=not plan.short or loop.rotates_query or bool(plan.window), SCAN_BLOCK=256, USE_ROPE=use_rope,
                CS_PER_PAGE=plan.cs_per_page, DOT_PREC=dot_prec,
                IDX64=idx64, NPG=max(1, block_n // page_size), PREFETCH=plan.prefetch, QROT=int(loop),
                PACKED_ROT=plan.packed_rot, FROM_DELTA=plan.from_delta, LOOKAHEAD=plan.lookahead,
                APPROX=not _interpreting(),
                num_warps=plan.num_warps, num_stages=plan.num_stages, **win, **ape,
            )
        except Exception as e:  # noqa: BLE001
            if not loop.rotates_query or _interpreting() or torch.cuda.is_current_stream_capturing():
                raise
            # A Triton compiler failure on this shape (seen for tiny head dims in float32):
            # remember it and serve the shape with the key-rotating loop, which computes
            # the same function.
            _QROT_FAILED.add(plan.loop_key)
            warnings.warn(f"query-rotating attention kernel failed to compile for head_dim={d}, "
                          f"{k_cache.dtype}, pages of {page_size} ({type(e).__name__}); using the "
                          "key-rotating kernel for this shape", RuntimeWarning, stacklevel=3)
            return paged_attention_triton(
                q, q_pos, cu_seqlens_q, k_cache, v_cache, block_table, block_pos, block_delta, block_len,
                inv_freq, sm_scale, out, max_seqlen_q=max_seqlen_q, use_rope=use_rope,
                rope=None if rope_arg is None else (rope_arg[0], rope_arg[1]),
                options=KernelOptions(config=plan.config, loop="per_tile",
                                      num_splits=plan.num_splits if batch_invariant else None),
                window=plan.window or None,
                **({} if ape_args is None else dict(ctx_range=ape_args[0], ctx_temperature=1.0 / ape_args[1],
                                                    ctx_lse_scale=ape_args[2])))
    if n_parts > 1:
        _merge_splits[(total_q * hq,)](
            part_o, part_lse, target, target.stride(0), target.stride(1), n_parts,
            NUM_Q_HEADS=hq, SPLITS_P=max(2, next_pow2(n_parts)),
            HEAD_DIM=d, num_warps=4, **({} if not plan.ape else dict(APE=True, ctx_lse_scale=ape_args[2])),
        )
    if target is not out:
        out.copy_(target)
    return out
