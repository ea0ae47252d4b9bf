"""Plain-torch reference of deferred-RoPE paged attention: the specification.

Every Triton kernel in this package has a twin here, and the tests hold them together
on random inputs. The engine also uses these functions as its CPU path.

Conventions shared by all functions
-----------------------------------
* KV lives in pages: ``k_cache`` / ``v_cache`` of shape
  ``(num_pages, page_size, num_kv_heads, head_dim)`` for one layer (or with a leading
  ``num_layers`` dimension where a function says so).
* Keys are stored *already rotated* by RoPE at the position at which they were computed
  (their "stored" position). A request lists, for each page it attends to, the position
  its slot 0 has in the request's own frame (``block_pos``) and the rotation that must be
  added to the stored keys to place them there (``block_delta``, in positions). For pages
  computed in the request's own frame the delta is 0; for a chunk encoded alone at local
  positions ``0..L-1`` and placed at logical offset ``d`` it is ``d``.
* Because ``<R(a) q, R(b) k> = <R(a - d) q, R(b - d) k>``, the delta can be applied to the
  key tile (``R(delta) k``) or, equivalently, to the query (``R(-delta) q``): the reference
  rotates keys, kernels may do either.
* RoPE is the rotate-half ("NeoX", Hugging Face Llama) convention on the first
  ``rotary_dim = 2 * len(inv_freq)`` dims of each head; the remaining dims are not rotated.
  ``inv_freq`` already holds any scaling (linear, llama3, yarn...). A model-level
  attention scale on cos/sin (yarn's mscale) is applied when keys are first stored, never
  by a delta rotation, which is a pure rotation.
* Masking: a query at position ``p`` sees key slot ``s`` of table entry ``j`` iff
  ``s < block_len[b, j]`` and ``block_pos[b, j] + s <= p``. Chunk-context semantics
  (isolated / prefix) are expressed by which pages a sequence's table lists.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .options import calibration_on

__all__ = [
    "rope_cos_sin",
    "apply_rope",
    "rotate_by_delta",
    "paged_attention_ref",
    "paged_attention_mass_ref",
    "grouped_attention_ref",
    "rerotate_copy_ref",
    "write_kv_ref",
]


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0):
    """cos and sin of RoPE angles.

    Parameters
    ----------
    positions : ``(n,)`` integer tensor (may be negative).
    inv_freq : ``(rotary_dim // 2,)`` float32.
    scale : multiplier on cos and sin (yarn's attention factor; 1.0 otherwise).

    Returns
    -------
    cos, sin : ``(n, rotary_dim)`` float32, the half-width table repeated twice
    (rotate-half layout).
    """
    ang = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos() * scale, ang.sin() * scale


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(n, heads, head_dim)`` by per-row ``cos``/``sin``
    ``(n, rotary_dim)``; dims past ``rotary_dim`` pass through. Computes in float32
    and returns ``x.dtype``."""
    rd = cos.shape[-1]
    xf = x.to(torch.float32)
    xr, xp = xf[..., :rd], xf[..., rd:]
    half = rd // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    out = xr * cos[:, None, :] + rot * sin[:, None, :]
    if xp.shape[-1]:
        out = torch.cat([out, xp], dim=-1)
    return out.to(x.dtype)


def rotate_by_delta(k: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Pure RoPE rotation of keys ``(n, heads, head_dim)`` by ``delta`` ``(n,)`` positions."""
    cos, sin = rope_cos_sin(delta, inv_freq)
    return apply_rope(k, cos, sin)


def _entry_slots(k_cache, v_cache, pages, pos0, lens, delta):
    """The valid slots of table entries (``pages``, the position of each one's slot 0, its
    valid length and delta; 1-D int64), in entry order: keys and values as stored (``v``
    ``None`` without ``v_cache``), each slot's position and delta, and the mask of valid
    slots over ``entries x page_size``."""
    page_size, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    slots = torch.arange(page_size, device=k_cache.device)
    valid = (slots[None, :] < lens[:, None]).reshape(-1)  # (n_entries * page_size,)
    kpos = (pos0[:, None] + slots[None, :]).reshape(-1)[valid]
    dl = delta[:, None].expand(-1, page_size).reshape(-1)[valid]
    k = k_cache[pages].reshape(-1, hkv, d)[valid]
    v = None if v_cache is None else v_cache[pages].reshape(-1, hkv, d)[valid]
    return k, v, kpos, dl, valid


def _sequence_keys(b, k_cache, v_cache, block_table, block_pos, block_delta, block_len, inv_freq,
                   slot_ids: bool = False):
    """Sequence ``b``'s valid key slots, in table order: keys rotated by their entry's delta,
    values (``None`` without ``v_cache``), positions, and (with ``slot_ids``, else ``None``)
    flat slot indices ``entry * page_size + slot``. ``None`` when its table has no valid
    entry."""
    page_size = k_cache.shape[1]
    lens = block_len[b]
    used = lens > 0
    if not bool(used.any()):
        return None
    k, v, kpos, delta, valid = _entry_slots(k_cache, v_cache, block_table[b][used].long(),
                                            block_pos[b][used].long(), lens[used].long(),
                                            block_delta[b][used].long())
    flat = None
    if slot_ids:
        ent = torch.nonzero(used).flatten()
        slots = torch.arange(page_size, device=k_cache.device)
        flat = (ent[:, None] * page_size + slots[None, :]).reshape(-1)[valid]
    if bool((delta != 0).any()):
        k = rotate_by_delta(k, delta, inv_freq)
    return k, v, kpos, flat


def _visible(q_pos, kpos, window):
    """``(nq, nk)``: query ``i`` sees key ``j`` (causal by position, and within ``window``)."""
    qp = q_pos.long()[:, None]
    allowed = kpos[None, :] <= qp
    if window is not None:
        allowed &= qp - kpos[None, :] < window
    return allowed


def _sdpa(qb, kb, vb, allowed, sm_scale, group):
    """``softmax(q k^T * scale, masked by allowed) v`` for one sequence, ``(h, nq, d)``. Where
    ``allowed`` is plain causal attention of the queries over keys ending with their own (a
    prompt prefilled after a cached prefix of at most its length), the same result through
    ``is_causal`` (the queries padded in front to the keys' count): CPU's fused kernel then
    skips the masked half instead of reading an explicit mask."""
    nq, nk = allowed.shape
    if nk - nq <= nq and torch.equal(allowed, torch.ones(nq, nk, dtype=torch.bool, device=allowed.device)
                                     .tril(nk - nq)):
        qp = qb if nq == nk else torch.cat([qb.new_zeros(qb.shape[0], nk - nq, qb.shape[2]), qb], 1)
        o = F.scaled_dot_product_attention(qp[None], kb[None], vb[None], is_causal=True, scale=sm_scale,
                                           enable_gqa=group > 1)[0]
        return o[:, nk - nq:]
    return F.scaled_dot_product_attention(qb[None], kb[None], vb[None], attn_mask=allowed[None, None],
                                          scale=sm_scale, enable_gqa=group > 1)[0]


def paged_attention_ref(
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
    window: int | None = None,
    max_seqlen_q: int | None = None,
    ctx_range: torch.Tensor | None = None,
    ctx_temperature: float = 1.0,
    ctx_lse_scale: float = 1.0,
) -> torch.Tensor:
    """Deferred-RoPE attention of a varlen batch of queries over paged KV.

    Serves prefill (many queries per sequence) and decode (one) alike.

    Parameters
    ----------
    q : ``(total_q, num_q_heads, head_dim)`` queries, RoPE already applied at ``q_pos``.
    q_pos : ``(total_q,)`` int, position of each query in its sequence's frame.
    cu_seqlens_q : ``(batch + 1,)`` int, query offsets of each sequence in ``q``.
    k_cache, v_cache : ``(num_pages, page_size, num_kv_heads, head_dim)``.
    block_table : ``(batch, max_blocks)`` int32 page ids; entries with ``block_len == 0``
        are padding and never read.
    block_pos : ``(batch, max_blocks)`` int, position of each entry's slot 0 in the
        sequence's frame.
    block_delta : ``(batch, max_blocks)`` int, rotation (in positions) to add to the
        stored keys of each entry.
    block_len : ``(batch, max_blocks)`` int, valid slots of each entry (0..page_size).
    inv_freq : ``(rotary_dim // 2,)`` float32.
    sm_scale : softmax scale (usually ``head_dim ** -0.5``).
    out : optional ``(total_q, num_q_heads, head_dim)`` output buffer.
    window : sliding window (Gemma 3, Mistral): a query at ``p`` also needs
        ``p - key_pos < window``. ``None``: no window.
    max_seqlen_q : accepted for signature parity with the Triton launcher; unused.
    ctx_range, ctx_temperature, ctx_lse_scale : APE-style calibration of how queries after
        the retrieved documents read them (off by default: ``ctx_range=None``, or
        temperature and scale 1). ``ctx_range`` ``(batch, 2)`` int gives each sequence's
        context key positions ``[start, end)`` (``start == end``: none). For a query at
        position ``>= end``, the context keys' logits are divided by ``ctx_temperature`` and
        the context's log-sum-exp is multiplied by ``ctx_lse_scale``: with ``C`` the context
        keys and ``N`` the others it sees, ``o = (e^{S L_C} o_C + e^{L_N} o_N) / (e^{S L_C} +
        e^{L_N})``, ``L_C = logsumexp(z_C / T)``, ``o_C = softmax(z_C / T) V_C``. That is one
        softmax over logits ``z_j / T + (S - 1) L_C`` on ``C`` and ``z_j`` elsewhere. The
        cached KV is not touched: it is a per-query change, so chunk KV stays shared.

    Returns
    -------
    ``(total_q, num_q_heads, head_dim)`` in ``q.dtype``. A query that sees no key gets 0.
    """
    ape = ctx_range is not None and calibration_on(ctx_temperature, ctx_lse_scale)
    total_q, hq, d = q.shape
    hkv = k_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} is not a multiple of num_kv_heads {hkv}")
    group = hq // hkv
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for b in range(len(cu) - 1):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        keys = _sequence_keys(b, k_cache, v_cache, block_table, block_pos, block_delta, block_len, inv_freq)
        if keys is None:
            out[q0:q1] = 0
            continue
        k, v, kpos, _ = keys
        allowed = _visible(q_pos[q0:q1], kpos, window)  # (nq, nk)
        qb = q[q0:q1].to(torch.float32).transpose(0, 1)  # (hq, nq, d)
        kb = k.to(torch.float32).transpose(0, 1)  # (hkv, nk, d)
        vb = v.to(torch.float32).transpose(0, 1)
        if ape:
            c0, c1 = (int(x) for x in ctx_range[b].tolist())
            after = q_pos[q0:q1].long() >= c1  # (nq,) queries past the context
            if c1 > c0 and bool(after.any()):
                in_ctx = (kpos >= c0) & (kpos < c1)  # (nk,)
                o = _ape_attention(qb, kb, vb, allowed, in_ctx, after, sm_scale, group, ctx_temperature,
                                   ctx_lse_scale)
                o = o.masked_fill(~allowed.any(-1)[None, :, None], 0.0)
                out[q0:q1] = o.transpose(0, 1).to(out.dtype)
                continue
        o = _sdpa(qb, kb, vb, allowed, sm_scale, group)
        o = o.masked_fill(~allowed.any(-1)[None, :, None], 0.0)  # rows with no visible key
        out[q0:q1] = o.transpose(0, 1).to(out.dtype)
    return out


def _ape_attention(qb, kb, vb, allowed, in_ctx, after, sm_scale, group, temperature, lse_scale):
    """``paged_attention_ref``'s APE path for one sequence: explicit logits, context logits of
    the rows in ``after`` tempered and offset by ``(S - 1) * L_C``."""
    if group > 1:
        kb, vb = kb.repeat_interleave(group, 0), vb.repeat_interleave(group, 0)
    z = torch.einsum("hqd,hkd->hqk", qb, kb) * sm_scale
    z = z.masked_fill(~allowed[None], float("-inf"))
    cmask = (in_ctx[None, :] & allowed & after[:, None])[None]  # (1, nq, nk) context keys of APE rows
    zc = torch.where(cmask, z / temperature, torch.full_like(z, float("-inf")))
    lse_c = torch.logsumexp(zc, dim=-1, keepdim=True)  # (h, nq, 1); -inf where no context key
    lse_c = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
    z = torch.where(cmask, zc + (lse_scale - 1.0) * lse_c, z)
    p = torch.softmax(z, dim=-1).nan_to_num(0.0)
    return p @ vb


def paged_attention_mass_ref(
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
    *,
    window: int | None = None,
    max_seqlen_q: int | None = None,
) -> torch.Tensor:
    """Attention mass each key slot receives: the softmax probabilities of
    ``paged_attention_ref`` (same arguments, same masking), summed over query heads and
    over the sequence's queries. Used to choose which cached chunk tokens to recompute
    (the ones the question attends to most).

    Returns
    -------
    ``(batch, max_blocks, page_size)`` float32; padding entries and invalid slots get 0.
    """
    total_q, hq, d = q.shape
    B, W = block_table.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    mass = torch.zeros(B, W, page_size, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for b in range(len(cu) - 1):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0:
            continue
        keys = _sequence_keys(b, k_cache, None, block_table, block_pos, block_delta, block_len, inv_freq,
                              slot_ids=True)
        if keys is None:
            continue
        k, _, kpos, flat = keys
        allowed = _visible(q_pos[q0:q1], kpos, window)
        qb = q[q0:q1].to(torch.float32).transpose(0, 1)  # (hq, nq, d)
        kb = k.to(torch.float32).transpose(0, 1).repeat_interleave(group, dim=0)  # (hq, nk, d)
        s = torch.matmul(qb, kb.transpose(1, 2)) * sm_scale
        s = s.masked_fill(~allowed[None], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key: 0
        mass.view(B, -1)[b].index_add_(0, flat, p.sum(dim=(0, 1)))
    return mass


def grouped_attention_ref(
    q: torch.Tensor,
    q_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    block_pos: torch.Tensor,
    block_delta: torch.Tensor,
    block_len: torch.Tensor,
    inv_freq: torch.Tensor,
    sm_scale: float,
    plan,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shared-chunk attention by work items (``lazyllm.kernels.grouping``): the same
    function as ``paged_attention_ref`` over the tables the plan was made from, computed as
    the kernel does: per item and member a partial softmax over the item's pages, keys read
    in their stored frame with the *query* rotated by ``-delta``, then each query's partials
    merged by log-sum-exp.

    ``plan``: a ``GroupPlan`` or ``GroupTensors`` (``items``, ``pages``, ``members``,
    ``own``, ``cols``, ``parts``). Shared items take page, stored position and length from
    ``plan.pages`` and each member's delta from ``plan.members``; a query's own pages are
    read from the step's tables ``block_*`` at ``(own row, plan.cols[...])`` (a column with
    ``block_len == 0`` is padding) and form one more partial. Returns ``(total_q, heads, d)`` in ``q.dtype``; 0 for
    a query with no visible key.
    """
    total_q, hq, d = q.shape
    group = hq // k_cache.shape[2]
    half = int(inv_freq.numel())
    if out is None:
        out = torch.empty_like(q)
    members = torch.as_tensor(plan.members).long()
    n_slots = int(members.shape[0])
    # the shared slots, then one slot per query for its own pages
    part_o = torch.zeros((n_slots + total_q, hq, d), dtype=torch.float32)
    part_lse = torch.full((n_slots + total_q, hq), float("-inf"), dtype=torch.float32)

    def partial(qi, slot, pages, kpos0, lens, delta):
        k, v, kpos, dl, valid = _entry_slots(k_cache, v_cache, pages, kpos0, lens, delta)  # stored frame
        if not bool(valid.any()):
            return
        k, v = k.to(torch.float32), v.to(torch.float32)
        qr = q[qi].to(torch.float32)[None].expand(k.shape[0], hq, d).clone()
        if half:  # the query in each key's stored frame: R(-delta) q
            cos, sin = rope_cos_sin(-dl, inv_freq)
            qr = apply_rope(qr, cos, sin)
        z = (qr * k.repeat_interleave(group, dim=1)).sum(-1) * sm_scale  # (nk, hq)
        z = z.masked_fill((kpos > int(q_pos[qi]))[:, None], float("-inf"))
        lse = torch.logsumexp(z, dim=0)
        w = torch.exp(z - torch.where(torch.isfinite(lse), lse, 0.0)[None])
        part_o[slot] = (w[..., None] * v.repeat_interleave(group, dim=1)).sum(0)
        part_lse[slot] = lse

    pg = torch.as_tensor(plan.pages).long()
    for m_off, m_n, p_off, n_p in torch.as_tensor(plan.items).tolist():
        run = pg[p_off:p_off + n_p]
        for qi, _, slot, delta in members[m_off:m_off + m_n].tolist():
            partial(qi, slot, run[:, 0], run[:, 1] + delta, run[:, 2], torch.full((n_p,), delta))
    cols = torch.as_tensor(plan.cols).long()
    for qi, (b, c_off, n_c) in enumerate(torch.as_tensor(plan.own).tolist()):
        if n_c:
            cs = cols[c_off:c_off + n_c]
            partial(qi, n_slots + qi, block_table[b, cs].long(), block_pos[b, cs].long(), block_len[b, cs].long(),
                    block_delta[b, cs].long())
    for qi, (first, n) in enumerate(torch.as_tensor(plan.parts).tolist()):
        idx = list(range(first, first + n)) + [n_slots + qi]
        lse = part_lse[idx]  # (n + 1, hq)
        tot = torch.logsumexp(lse, dim=0)
        w = torch.where(torch.isfinite(lse), torch.exp(lse - torch.where(torch.isfinite(tot), tot, 0.0)[None]), 0.0)
        out[qi] = (w[..., None] * part_o[idx]).sum(0).to(out.dtype)  # 0 where nothing is visible
    return out

def rerotate_copy_ref(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
) -> None:
    """Block-Attention baseline: copy pages ``src -> dst`` rotating keys by ``delta``.

    Parameters
    ----------
    k_cache, v_cache : ``(num_layers, num_pages, page_size, num_kv_heads, head_dim)``;
        written in place at ``dst_pages`` for every layer.
    src_pages, dst_pages : ``(n,)`` int page ids.
    delta : ``(n,)`` int rotation in positions for each copied page.
    inv_freq : ``(rotary_dim // 2,)`` float32.
    """
    n_layers, _, page_size, hkv, d = k_cache.shape
    src, dst = src_pages.long(), dst_pages.long()
    k = k_cache[:, src]  # (L, n, ps, h, d)
    dl = delta.long()[None, :, None].expand(n_layers, -1, page_size).reshape(-1)
    k = rotate_by_delta(k.reshape(-1, hkv, d), dl, inv_freq).reshape(k.shape)
    k_cache[:, dst] = k
    v_cache[:, dst] = v_cache[:, src]


def write_kv_ref(k_cache, v_cache, slot_mapping, k, v) -> None:
    """Scatter new keys/values ``(n, num_kv_heads, head_dim)`` into one layer's pages at
    flat slots ``slot_mapping`` ``(n,)`` (``page * page_size + slot``)."""
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    idx = slot_mapping.long()
    kf.index_copy_(0, idx, k.to(kf.dtype))
    vf.index_copy_(0, idx, v.to(vf.dtype))
