"""Exploration of reusable recovery settings (issue 7), in transformers, cache-true.

Every setting keeps chunk KV reusable: pass 1 encodes each chunk under the engine's
semantics (``isolated`` or ``prefix``), pass 2 recomputes a chosen set of chunk tokens in
full context (their cached KV masked out) with the question and the answer
(``quality_mask_study.hf_cache_true``, checked equal to the engine). What varies:

- which chunk tokens are recomputed: first k of each chunk; top fraction r by key (or
  value) deviation at one or several layers (CacheBlend); top fraction r by the attention
  the question's queries give them in a first pass over the cached KV; mixtures;
- attention rescaling at query time (APE-style): an additive logit bias ``b`` on chunk keys
  (scales the attention mass on the chunk context by ``e^b``) and a temperature ``t``
  multiplying chunk-key logits, for the question and answer queries.

    python benchmarks/quality_explore.py --settings "prefix:first=4" "prefix:dev=0.15@1" ...

A setting is ``ctx:opt=..,opt=..`` with options ``first=K``, ``dev=R@L1/L2`` (key deviation,
mean over the listed layers), ``vdev=R@L``, ``attn=R@L1/L2`` (question attention, mean over
those layers; ``all``: every layer), ``bias=B``, ``temp=T``, ``biasrec=1`` (also bias the
recomputed tokens' queries).
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

import quality_mask_study as qs

STATE = {"record": None, "temp": None, "layers": None}


def study_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention with an optional per-(query, key) logit multiplier (``STATE['temp']``)
    and an optional record of the probabilities (``STATE['record']``, per layer)."""
    n_rep = query.shape[1] // key.shape[1]
    k, v = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    s = torch.matmul(query.float(), k.float().transpose(2, 3)) * scaling
    li = getattr(module, "layer_idx", 0)
    if STATE["temp"] is not None and (STATE["layers"] is None or li in STATE["layers"]):
        s = s * STATE["temp"]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            s = s.masked_fill(~attention_mask, float("-inf"))
        else:
            s = s + attention_mask
    p = torch.softmax(s, dim=-1)
    if STATE["record"] is not None:
        STATE["record"].append(p[0].detach())  # (heads, q, k)
    o = torch.matmul(p.to(v.dtype), v)
    return o.transpose(1, 2).contiguous(), None


AttentionInterface.register("study", study_attention)


def parse_setting(s: str):
    ctx, _, rest = s.partition(":")
    opts = {}
    for part in filter(None, rest.split(",")):
        k, _, v = part.partition("=")
        opts[k] = v
    return ctx, opts


def _layers(spec: str, n_layers: int):
    if spec == "all":
        return list(range(n_layers))
    return [int(x) for x in spec.split("/")]


@torch.inference_mode()
def full_head_kv(hf, item):
    """Per layer (keys, values) of prefix + chunks under full causal attention."""
    from transformers import DynamicCache

    L = qs.layout(item)
    nh = L["n_head"]
    cache = DynamicCache(config=hf.config)
    hf(input_ids=L["ids"][:nh][None], position_ids=torch.arange(nh)[None], past_key_values=cache, use_cache=True)
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


@torch.inference_mode()
def question_attention(hf, item, kv, layers, agg="mean", oracle=False, recomputed=None):
    """Attention mass the question's queries (suffix only: the answer is unknown at
    selection time) give each head token, mean over ``layers``, heads and queries, in a
    pass over the cached KV without recompute."""
    from transformers import DynamicCache

    L = qs.layout(item)
    nh, npr = L["n_head"], L["n_prompt"]
    if oracle:
        npr = len(L["ids"])
    if recomputed is not None and bool(recomputed.any()):
        # attention after recomputing ``recomputed``: run them, then read the question rows
        rec_idx = torch.nonzero(recomputed).flatten()
        new_pos = torch.cat([rec_idx, torch.arange(nh, npr)])
        key_pos = torch.cat([torch.arange(nh), new_pos])
        key_ok = torch.cat([~recomputed, torch.ones(len(new_pos), dtype=torch.bool)])
        mask = (key_pos[None, :] <= new_pos[:, None]) & key_ok[None, :]
        cache = DynamicCache(config=hf.config)
        for li, (k, v) in enumerate(kv):
            cache.update(k, v, li)
        STATE["record"] = []
        try:
            hf(input_ids=L["ids"][new_pos][None], attention_mask=mask[None, None], position_ids=new_pos[None],
               past_key_values=cache, use_cache=True)
            rec = STATE["record"]
        finally:
            STATE["record"] = None
        nr = len(rec_idx)
        out = []
        for li in layers:
            a = rec[li][:, nr:, :]  # question queries
            head = a[:, :, :nh].clone()
            # the recomputed tokens' mass sits in their new columns
            head[:, :, rec_idx] = a[:, :, nh:nh + nr]
            out.append(head)
        a = torch.stack(out)  # (layers, heads, q, nh)
        return a.mean(dim=(0, 1, 2)) if agg == "mean" else a.amax(dim=(1, 2)).mean(0)
    pos = torch.arange(nh, npr)
    cache = DynamicCache(config=hf.config)
    for li, (k, v) in enumerate(kv):
        cache.update(k, v, li)
    STATE["record"] = []
    try:
        mask = (torch.arange(npr)[None, :] <= pos[:, None])
        hf(input_ids=L["ids"][nh:npr][None], attention_mask=mask[None, None], position_ids=pos[None],
           past_key_values=cache, use_cache=True)
        rec = STATE["record"]
    finally:
        STATE["record"] = None
    a = torch.stack([rec[li][:, :, :nh] for li in layers])
    return a.mean(dim=(0, 1, 2)) if agg == "mean" else a.amax(dim=(1, 2)).mean(0)


def select(hf, item, ctx, opts, kv, cache_full):
    L = qs.layout(item)
    nh = L["n_head"]
    is_chunk = L["kind"][:nh] == 1
    sel = torch.zeros(nh, dtype=torch.bool)
    if "first" in opts:
        sel |= is_chunk & (L["off"][:nh] < int(opts["first"]))
    n_chunk = int(is_chunk.sum())
    for key in ("dev", "vdev", "attn", "mix"):
        if key not in opts:
            continue
        r, _, lay = opts[key].partition("@")
        layers = _layers(lay or "1", len(kv))
        if key in ("dev", "vdev"):
            j = 0 if key == "dev" else 1
            full = cache_full()
            score = torch.stack([(full[li][j][0] - kv[li][j][0]).pow(2).sum(dim=(0, 2)).sqrt() for li in layers]).mean(0)
        elif key == "attn":
            rounds = int(opts.get("iter", "1"))
            n_total = min(n_chunk, int(math.ceil(float(r) * n_chunk)))
            base = sel.clone()
            for rd in range(rounds - 1):  # gradual: pick a share, recompute, look again
                score = question_attention(hf, item, kv, layers, opts.get("agg", "mean"), opts.get("oracle") == "1",
                                           sel if bool(sel.any()) else None)
                score = score.masked_fill(~is_chunk | sel, float("-inf"))
                take = n_total * (rd + 1) // rounds - int((sel & ~base).sum())
                if take > 0:
                    sel[torch.topk(score, take).indices] = True
            score = question_attention(hf, item, kv, layers, opts.get("agg", "mean"), opts.get("oracle") == "1",
                                       sel if bool(sel.any()) else None)
            r = str((n_total - int((sel & ~base).sum())) / n_chunk)
        score = score.masked_fill(~is_chunk | sel, float("-inf"))
        n_pick = min(n_chunk, int(math.ceil(float(r) * n_chunk)))
        n_pick = max(0, n_pick - int((sel & is_chunk).sum())) if opts.get("budget") == "total" else n_pick
        if n_pick:
            sel[torch.topk(score, n_pick).indices] = True
    return sel


def bias_matrix(item, sel, opts):
    """Additive bias / temperature for pass 2: queries = recomputed tokens, then question
    and answer; keys = head cache then the new tokens."""
    if "bias" not in opts and "temp" not in opts:
        return None, None
    L = qs.layout(item)
    nh, n = L["n_head"], len(L["ids"])
    rec_idx = torch.nonzero(sel).flatten()
    new_pos = torch.cat([rec_idx, torch.arange(nh, n)])
    key_pos = torch.cat([torch.arange(nh), new_pos])
    key_chunk = L["kind"][key_pos] == 1
    q_on = torch.ones(len(new_pos), dtype=torch.bool)
    if opts.get("biasrec", "0") != "1":
        q_on[: len(rec_idx)] = False
    on = q_on[:, None] & key_chunk[None, :]
    bias = temp = None
    if "bias" in opts:
        bias = torch.where(on, torch.tensor(float(opts["bias"])), torch.tensor(0.0))
    if "temp" in opts:
        temp = torch.where(on, torch.tensor(float(opts["temp"])), torch.tensor(1.0))
    return bias, temp


def run(hf, items, setting: str):
    ctx, opts = parse_setting(setting)
    per, n_rec, n_chunk = [], 0, 0
    kinds = {}
    for it in items:
        kv = it.setdefault("_kv", {}).get(ctx)
        if kv is None:
            kv = it["_kv"][ctx] = qs.hf_chunk_cache(hf, it, ctx)

        def cache_full(it=it):
            if "_full" not in it:
                it["_full"] = full_head_kv(hf, it)
            return it["_full"]

        sel = select(hf, it, ctx, opts, kv, cache_full)
        bias, temp = bias_matrix(it, sel, opts)
        STATE["temp"] = None if temp is None else temp[None, None]
        STATE["layers"] = None if "layers" not in opts else set(_layers(opts["layers"], len(kv)))
        try:
            lg = qs.hf_cache_true(hf, it, kv, sel, bias)
        finally:
            STATE["temp"] = None
        m = qs.metrics(it["ref"], lg)
        per.append(m)
        kinds.setdefault(it["kind"], []).append(m)
        L = qs.layout(it)
        n_rec += int(sel.sum())
        n_chunk += int((L["kind"] == 1).sum())
    out = dict(setting=setting, recompute=n_rec / n_chunk, **qs.summarize(per))
    out["per_kind"] = {k: qs.summarize(v) for k, v in kinds.items()}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cache", default="/tmp/qstudy_full.pt")
    ap.add_argument("--settings", nargs="+", required=True)
    ap.add_argument("--one-order", action="store_true", help="only the first chunk order of each question")
    a = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    hf, tok, items, prompts, *_ = qs.prepare(["--quick"] if a.quick else [], a.cache)
    if a.one_order:
        items = [it for it, p in zip(items, prompts) if p.order == 0]
    hf.set_attn_implementation("study")
    for s in a.settings:
        t0 = time.perf_counter()
        r = run(hf, items, s)
        pk = " ".join(f"{k}:{100 * v['top1']:.1f}/{v['kl']:.3f}" for k, v in r["per_kind"].items())
        print(f"{s:40s} rec {100 * r['recompute']:5.1f}%  top1 {100 * r['top1']:5.1f}%  KL {r['kl']:.4f}  [{pk}]"
              f"  ({time.perf_counter() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, qs.ROOT)
    main()
