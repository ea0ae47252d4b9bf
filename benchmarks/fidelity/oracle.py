"""Oracle recompute selections for ``quality.py`` (an upper bound for selective recompute,
measured, not engine options): chosen with full attention's KV and attention over the same
prompt; and what each oracle setting picked."""
from __future__ import annotations

import math
import statistics

import torch

# -- oracle selection (an upper bound; measurement only) -------------------------------
# Recompute selections that read what a real system does not have: the KV and attention
# of full attention over the same prompt. They are not engine options: the benchmark adds
# them to the engine's selection names for its own process (``install_oracle_selection``).
#   oracle-kv     : tokens whose cached K and V deviate most from full attention's, summed
#                   over every layer (each layer's squared error over its mean squared norm
#                   of full attention's K, resp. V): CacheBlend's ideal criterion;
#   oracle-attn   : tokens the answer attends to most under full attention (softmax mass
#                   from the rows that predict the scored answer tokens, summed over
#                   layers, heads and rows; a generation request: the question's rows);
#   oracle-kvattn : the product of the two, each scaled to its maximum;
#   oracle-effect : per layer, the answer's attention mass on the token times the root of
#                   its relative K+V deviation there (first-order size of the change in the
#                   answer's attention output), summed over layers.
ORACLE_SELECTIONS = ("oracle-kv", "oracle-attn", "oracle-kvattn", "oracle-effect")
ORACLE_LOG: list | None = None  # a list: each oracle choice is recorded here (``oracle_summary``)


@torch.inference_mode()
def full_context_kv(model, ids: torch.Tensor, query_from: int | None = None):
    """Dense causal forward of ``ids`` at positions ``0..n-1`` through every layer (the
    arithmetic of ``probe_keys``). Returns per layer the keys (rotated at their positions)
    and values ``(n, kv_heads, head_dim)``, and with ``query_from`` the attention
    probabilities that rows ``query_from..n-1`` give every position, per layer and summed
    over heads, ``(layers, n - query_from, n)`` float32 (else ``None``)."""
    from lazyllm.kernels.reference import rope_cos_sin

    spec = model.spec
    n = ids.shape[0]
    pos = torch.arange(n, device=ids.device)
    tables = [rope_cos_sin(pos, f, sc) for f, sc in zip(model.inv_freqs, model.rope_scales)]
    group = spec.num_heads // spec.num_kv_heads
    h = model._embed(ids)
    ks, vs, mass = [], [], []
    for w in model.layers:
        q, k, v = model.qkv_proj(h, w, *tables[w["freq"]])
        ks.append(k)
        vs.append(v)
        mask = pos[None, :] <= pos[:, None]
        if w["window"] is not None:
            mask &= pos[:, None] - pos[None, :] < w["window"]
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            scale=spec.sm_scale, enable_gqa=group != 1)[0].transpose(0, 1)
        if query_from is not None:
            qq = q[query_from:].transpose(0, 1).float()  # (heads, m, d)
            kk = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # (heads, n, d)
            logits = (qq @ kk.transpose(1, 2)) * spec.sm_scale
            probs = logits.masked_fill(~mask[query_from:], float("-inf")).softmax(-1).sum(0)
            mass.append(probs)
        h = model.finish_layer(h, o, w)
    return ks, vs, (torch.stack(mass) if query_from is not None else None)


def oracle_scores(rec, r) -> torch.Tensor:
    """The oracle's score of every chunk token of request ``r`` (in chunk order, as
    ``Recovery.key_deviation`` returns them), for ``rec.selection``."""
    from lazyllm.kernels.reference import rotate_by_delta

    spans = r.plan.spans
    model, pool = rec.model, rec.pool
    dev = pool.k.device
    prompt = r.prompt_ids
    n_head = spans[-1].start + len(spans[-1].ids)
    ans_from = len(prompt) - r.logit_rows if r.logit_rows > 1 else n_head  # rows predicting the answer
    ks, vs, mass = full_context_kv(model, torch.tensor(prompt, dtype=torch.long, device=dev), n_head)
    pages_t, slots_t, deltas_t, rows_t = rec.chunk_token_slots(r)
    ans_layers = mass[:, ans_from - n_head:].sum(1)[:, rows_t]  # (layers, chunk tokens)
    kv = torch.zeros(len(rows_t), dtype=torch.float32, device=dev)
    effect = torch.zeros_like(kv)
    for li in range(len(ks)):
        inv = model.inv_freqs[model.freq_index[li]]
        kc = rotate_by_delta(pool.k[li][pages_t, slots_t], deltas_t, inv).float()
        vc = pool.v[li][pages_t, slots_t].float()
        kf, vf = ks[li][rows_t].float(), vs[li][rows_t].float()
        d = (kf - kc).pow(2).sum((-1, -2)) / kf.pow(2).sum((-1, -2)).mean().clamp_min(1e-30) + \
            (vf - vc).pow(2).sum((-1, -2)) / vf.pow(2).sum((-1, -2)).mean().clamp_min(1e-30)
        kv += d
        effect += ans_layers[li] * d.sqrt()
    ans = ans_layers.sum(0)
    question = mass[:, :max(ans_from - n_head, 1)].sum((0, 1))[rows_t]  # the question's own rows
    if rec.selection == "oracle-kv":
        score = kv
    elif rec.selection == "oracle-attn":
        score = ans
    elif rec.selection == "oracle-effect":
        score = effect
    else:
        score = (kv / kv.max().clamp_min(1e-30)) * (ans / ans.max().clamp_min(1e-30))
    if ORACLE_LOG is not None:
        ORACLE_LOG.append(dict(
            key=(rec.selection, rec.ratio, rec.first_tokens), scored=r.logit_rows > 1,
            lens=[len(s.ids) for s in spans], ids=[t for s in spans for t in s.ids], score=score.cpu(),
            kv=kv.cpu(), answer_mass=ans.cpu(), question_mass=question.cpu(),
            probe_deviation=rec.key_deviation(r).float().cpu()))
    return score


def _oracle_selection(rec, r, n_pick, exclude):
    """The recovery selection of every ``ORACLE_SELECTIONS`` name (``rec.selection`` says which)."""
    return oracle_scores(rec, r)


def install_oracle_selection() -> None:
    """Let ``LazyLLM(recompute_selection=...)`` take the ``ORACLE_SELECTIONS`` in this
    process: registers them as recovery selections (``lazyllm.config.register_selection``),
    scored by ``oracle_scores``; every other selection is unchanged. Idempotent."""
    from lazyllm.config import register_selection, selection_names

    for name in ORACLE_SELECTIONS:
        if name not in selection_names():
            register_selection(name)(_oracle_selection)


def _wants_oracle(args) -> bool:
    return any(o in (args.recoveries or "") + (args.settings_json or "") for o in ORACLE_SELECTIONS)


def oracle_summary(log: list, key=None) -> dict:
    """What the oracle picked (score requests only; ``key``: one setting's (selection,
    ratio, first tokens)): where in the chunks, how much of it the first tokens of each
    chunk, the engine's own criteria and the other oracle would have picked too, and the
    most frequent picked tokens."""
    rows = [e for e in log if e["scored"] and (key is None or e["key"] == key)]
    if not rows:
        return {}
    picks = n_total = 0
    first4 = first_chunk = in_q_top = in_dev_top = in_ans_top = in_kv_top = 0
    rel_pos = []
    counts: dict[int, int] = {}
    for e in rows:
        sel, ratio, k = e["key"]
        total = len(e["ids"])
        n_pick = min(total, math.ceil(ratio * total))
        top = set(torch.topk(e["score"], n_pick).indices.tolist())

        def top_of(x):
            return set(torch.topk(x, n_pick).indices.tolist())

        q_top, d_top, a_top, kv_top = (top_of(e["question_mass"]), top_of(e["probe_deviation"]),
                                       top_of(e["answer_mass"]), top_of(e["kv"]))
        starts, acc = [], 0
        for n in e["lens"]:
            starts.append(acc)
            acc += n
        for j in top:
            ci = max(c for c in range(len(starts)) if starts[c] <= j)
            i = j - starts[ci]
            first4 += i < 4
            first_chunk += ci == 0
            rel_pos.append(i / max(1, e["lens"][ci] - 1))
            counts[e["ids"][j]] = counts.get(e["ids"][j], 0) + 1
        in_q_top += len(top & q_top)
        in_dev_top += len(top & d_top)
        in_ans_top += len(top & a_top)
        in_kv_top += len(top & kv_top)
        picks += len(top)
        n_total += total
    frequent = sorted(counts.items(), key=lambda kv: -kv[1])[:12]
    return dict(requests=len(rows), picks=picks, chunk_tokens=n_total,
                in_first_4=first4 / picks, in_first_chunk=first_chunk / picks,
                mean_relative_position=statistics.mean(rel_pos),
                overlap_question_attention=in_q_top / picks, overlap_key_deviation_probe=in_dev_top / picks,
                overlap_answer_attention=in_ans_top / picks, overlap_kv_deviation=in_kv_top / picks,
                frequent_token_ids=frequent)



def _oracle_log_start(on: bool) -> None:
    """Record the oracle's choices from now on (a fresh log), or stop recording."""
    global ORACLE_LOG
    ORACLE_LOG = [] if on else None


def _oracle_picks(tok, log) -> dict:
    """``oracle_summary`` of each oracle setting recorded since ``_oracle_log_start``,
    logged; the frequent tokens as text."""
    out = {}
    for key in sorted({e["key"] for e in ORACLE_LOG or []}):
        summ = oracle_summary(ORACLE_LOG, key)
        if not summ:
            continue
        summ["frequent_tokens"] = [(tok.decode([t]), c) for t, c in summ.pop("frequent_token_ids")]
        name = f"{key[0]}-{key[1]}" + (f"+first-{key[2]}" if key[2] else "")
        out[name] = summ
        log(f"  oracle picks, {name}: " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in summ.items()))
    return out
