"""Is the issue's calibration reachable with *reusable* chunk KV? (issue 7)

The issue's figures were measured with transformers and 4-D masks. In one forward with a
mask where the first ``k`` tokens of each chunk attend to the full context, the other chunk
tokens attend to the *full-context* versions of those ``k`` tokens (same forward), so every
chunk token's KV carries other chunks' information: it is not the KV a cache can hold and
reuse in another request ("leaky"). The engine's recovery is cache-true: the chunk's other
tokens keep the KV they got when the chunk was encoded alone, only the recomputed tokens and
the question see the full context.

This script computes, on the prompts of ``benchmarks/quality.py`` (same builder, same
seed), with transformers only (4-D masks, explicit position ids, a ``DynamicCache``):

- ``leaky``: one forward, chunk token ``i`` of a chunk attends to the full context if
  ``i < k``, else to its own chunk (and, with ``prefix``, to the system prefix), all at
  their logical positions (the issue's setup);
- ``cache-true``: pass 1 encodes every chunk alone (``isolated``), or right after the
  prefix at positions ``P..P+L-1`` and then rotated to its logical offset (``prefix``, the
  engine's reusable semantics); pass 2 runs the recomputed tokens, the question and the
  answer at their logical positions over that cache, the recomputed tokens' old KV masked
  out and their new KV visible: exactly what the engine computes;
- ``engine``: the engine itself (``LazyLLM(reuse="lazy", recompute_first_tokens=k)``,
  chunks warmed in another order), to check that ``cache-true`` equals it.

Metrics as in ``benchmarks/quality.py``: top-1 agreement with full attention and mean
KL(full || setting) over the teacher-forced reference answer tokens.

    python benchmarks/quality_mask_study.py                   # 48 prompts, k in 0,4,16,32
    python benchmarks/quality_mask_study.py --quick --ks 0,4  # a slice
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from lazyllm import LazyLLM  # noqa: E402


def load_quality():
    path = os.path.join(ROOT, "benchmarks", "quality.py")
    spec = importlib.util.spec_from_file_location("lazyllm_quality_benchmark", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


quality = load_quality()


# -- data ------------------------------------------------------------------------------
def prepare(argv=None, cache_path: str | None = None):
    """Prompts of ``benchmarks/quality.py`` with their reference (full attention) answers
    and teacher-forced logits. Returns (hf model, tokenizer, items, prompts, canonical, args);
    each item: segments [(kind, ids)], answer ids, reference logits, prompt kind."""
    args = quality.parse_args(argv or [])
    if cache_path and os.path.exists(cache_path):
        blob = torch.load(cache_path, weights_only=False)
        if blob["argv"] == (argv or []):
            llm = LazyLLM(reuse="none", progress=False, kv_cache_bytes=64 << 20)
            hf, tok = llm.hf_model, llm.tokenizer
            llm.close()
            return hf, tok, blob["items"], blob["prompts"], blob["canonical"], args
    llm = LazyLLM(reuse="none", progress=False, kv_cache_bytes=args.kv_cache_mb << 20)
    hf, tok = llm.hf_model, llm.tokenizer
    docs = quality.build_corpus(llm.count_tokens, args.chunk_tokens)
    prompts, canonical = quality.build_prompts(docs, questions=args.questions, needles=args.needles,
                                               docs_per_prompt=args.docs_per_prompt, orders=args.orders,
                                               seed=args.seed)
    gens = llm.generate_batch(quality._gen_items(prompts, args))
    scores = quality._score_all(llm, prompts, [list(g.token_ids) for g in gens], args.score_workers)
    items = [dict(segments=[(k, list(s)) for k, s in g.prompt_segments], ans=list(g.token_ids), ref=sc.logits,
                  kind=p.kind) for p, g, sc in zip(prompts, gens, scores)]
    llm.close()
    if cache_path:
        torch.save(dict(argv=argv or [], items=items, prompts=prompts, canonical=canonical), cache_path)
    return hf, tok, items, prompts, canonical, args


def layout(item):
    """Per token of ``prompt + answer[:-1]``: segment index (prefix 0, chunk d 1..C, suffix
    and answer C+1), offset inside its segment, kind code (0 prefix, 1 chunk, 2 suffix)."""
    segs = item["segments"]
    ids, seg, off, kind = [], [], [], []
    for si, (k, s) in enumerate(segs):
        ids += s
        seg += [si] * len(s)
        off += range(len(s))
        kind += [{"prefix": 0, "chunk": 1, "suffix": 2}[k]] * len(s)
    n_prompt = len(ids)
    tail = item["ans"][:-1]
    ids += tail
    seg += [len(segs) - 1] * len(tail)
    off += range(len(segs[-1][1]), len(segs[-1][1]) + len(tail))
    kind += [2] * len(tail)
    t = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return dict(ids=t(ids), seg=t(seg), off=t(off), kind=t(kind), n_prompt=n_prompt,
                P=len(segs[0][1]), n_head=n_prompt - len(segs[-1][1]))


def metrics(ref: torch.Tensor, logits: torch.Tensor):
    lp = torch.log_softmax(ref.double(), -1)
    lq = torch.log_softmax(logits.double(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0)
    ag = ref.argmax(-1) == logits.argmax(-1)
    return kl.tolist(), ag.tolist()


def summarize(per_item):
    kl = [x for k, _ in per_item for x in k]
    ag = [x for _, a in per_item for x in a]
    return dict(top1=sum(ag) / len(ag), kl=sum(kl) / len(kl), tokens=len(kl))


# -- transformers variants ---------------------------------------------------------------
@torch.inference_mode()
def hf_full(hf, item):
    L = layout(item)
    n = len(L["ids"])
    out = hf(input_ids=L["ids"][None], position_ids=torch.arange(n)[None]).logits[0]
    return out[L["n_prompt"] - 1:].float()


def leaky_mask(L, k: int, ctx: str) -> torch.Tensor:
    """One-forward mask: chunk tokens past the first ``k`` of their chunk see their chunk
    (and the prefix with ``ctx='prefix'``); everything else sees everything before it."""
    n = len(L["ids"])
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    seg, kind, off = L["seg"], L["kind"], L["off"]
    restricted = (kind == 1) & (off >= k)
    rows = (seg[:, None] == seg[None, :])
    if ctx == "prefix":
        rows = rows | (kind[None, :] == 0)
    allowed = torch.where(restricted[:, None], rows, torch.ones(n, n, dtype=torch.bool))
    return causal & allowed


@torch.inference_mode()
def hf_leaky(hf, item, k: int, ctx: str):
    L = layout(item)
    n = len(L["ids"])
    mask = leaky_mask(L, k, ctx)
    out = hf(input_ids=L["ids"][None], attention_mask=mask[None, None],
             position_ids=torch.arange(n)[None]).logits[0]
    return out[L["n_prompt"] - 1:].float()


def _rotate(hf, k: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Pure RoPE rotation of cached keys ``(1, heads, n, d)`` by ``shift`` ``(n,)`` positions."""
    from transformers.models.llama.modeling_llama import rotate_half

    rot = hf.model.rotary_emb
    cos, sin = rot(k, shift[None])
    scale = float(getattr(rot, "attention_scaling", 1.0))
    cos, sin = (cos / scale)[:, None].to(k.dtype), (sin / scale)[:, None].to(k.dtype)
    return k * cos + rotate_half(k) * sin


@torch.inference_mode()
def hf_chunk_cache(hf, item, ctx: str):
    """Pass 1: per layer (keys, values) ``(1, kv_heads, n_head, d)`` of prefix + chunks under
    the engine's reusable semantics, keys at their logical positions."""
    from transformers import DynamicCache

    L = layout(item)
    nh, P = L["n_head"], L["P"]
    ids, seg, kind, off = L["ids"][:nh], L["seg"][:nh], L["kind"][:nh], L["off"][:nh]
    idx = torch.arange(nh)
    same = seg[:, None] == seg[None, :]
    if ctx == "prefix":
        pos = torch.where(kind == 1, P + off, idx)
        mask = (idx[None, :] <= idx[:, None]) & (same | (kind[None, :] == 0))
    else:
        pos = idx
        mask = (idx[None, :] <= idx[:, None]) & (same | ((kind[:, None] == 0) & (kind[None, :] == 0)))
    cache = DynamicCache(config=hf.config)
    hf(input_ids=ids[None], attention_mask=mask[None, None], position_ids=pos[None], past_key_values=cache,
       use_cache=True)
    kv = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        if ctx == "prefix":
            k = _rotate(hf, k, idx - pos)  # chunk token placed at its logical position
        kv.append((k.clone(), v.clone()))
    return kv


@torch.inference_mode()
def hf_cache_true(hf, item, kv, recompute: torch.Tensor, bias: torch.Tensor | None = None):
    """Pass 2 over the chunk cache ``kv``: the head tokens flagged in ``recompute`` (bool
    ``(n_head,)``), then the question and answer, at logical positions; recomputed tokens'
    cached KV is masked out, their new KV visible. ``bias``: optional additive logit bias
    ``(n_new, n_head + n_new)`` (attention-mass scaling), added where allowed."""
    from transformers import DynamicCache

    L = layout(item)
    nh, n = L["n_head"], len(L["ids"])
    rec_idx = torch.nonzero(recompute).flatten()
    new_pos = torch.cat([rec_idx, torch.arange(nh, n)])
    new_ids = L["ids"][new_pos]
    key_pos = torch.cat([torch.arange(nh), new_pos])
    key_ok = torch.cat([~recompute, torch.ones(len(new_pos), dtype=torch.bool)])
    allowed = (key_pos[None, :] <= new_pos[:, None]) & key_ok[None, :]
    if bias is None:
        mask = allowed
    else:
        mask = torch.where(allowed, bias.to(torch.float32), torch.tensor(float("-inf")))
    cache = DynamicCache(config=hf.config)
    for li, (k, v) in enumerate(kv):
        cache.update(k, v, li)
    out = hf(input_ids=new_ids[None], attention_mask=mask[None, None], position_ids=new_pos[None],
             past_key_values=cache, use_cache=True).logits[0]
    return out[len(rec_idx) + (L["n_prompt"] - nh) - 1:].float()


def first_k(item, k: int) -> torch.Tensor:
    L = layout(item)
    nh = L["n_head"]
    return (L["kind"][:nh] == 1) & (L["off"][:nh] < k)


# -- engine ------------------------------------------------------------------------------
def engine_scores(hf, tok, items, prompts, canonical, ctx: str, k: int, ratio: float = 0.0):
    llm = LazyLLM(model=hf, tokenizer=tok, reuse="lazy", chunk_context=ctx, recompute_first_tokens=k,
                  recompute_ratio=ratio, kv_cache_bytes=256 << 20, progress=False)
    llm.warm(canonical, system=quality.SYSTEM, progress=False)
    out = []
    for p, it in zip(prompts, items):
        sc = llm.score(p.question, chunks=p.chunks, system=quality.SYSTEM, continuation=it["ans"],
                       return_logits=True)
        out.append(sc.logits)
    llm.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the quality benchmark's --quick prompts")
    ap.add_argument("--ks", default="0,4,16,32")
    ap.add_argument("--contexts", default="isolated,prefix")
    ap.add_argument("--engine-ks", default=None, help="first-k values also run on the engine (default: all)")
    ap.add_argument("--cache", default=None, help="keep the prompts and reference logits in this file")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    torch.set_grad_enabled(False)
    hf, tok, items, prompts, canonical, args = prepare(["--quick"] if a.quick else [], a.cache)
    n_chunk = sum(len(s) for it in items for k, s in it["segments"] if k == "chunk")
    ks = [int(x) for x in a.ks.split(",")]
    engine_ks = ks if a.engine_ks is None else [int(x) for x in a.engine_ks.split(",") if x]
    rows = []
    full = [metrics(it["ref"], hf_full(hf, it)) for it in items]
    rows.append(dict(variant="transformers full vs engine full", ctx="-", k=None, recompute=0.0, **summarize(full)))
    print(rows[-1], flush=True)
    for ctx in a.contexts.split(","):
        caches = [hf_chunk_cache(hf, it, ctx) for it in items]
        for k in ks:
            rec = sum(int(first_k(it, k).sum()) for it in items) / n_chunk
            leaky = [metrics(it["ref"], hf_leaky(hf, it, k, ctx)) for it in items]
            rows.append(dict(variant="leaky (one forward, 4-D mask)", ctx=ctx, k=k, recompute=rec, **summarize(leaky)))
            print(rows[-1], flush=True)
            true = [hf_cache_true(hf, it, kv, first_k(it, k)) for it, kv in zip(items, caches)]
            mt = [metrics(it["ref"], lg) for it, lg in zip(items, true)]
            rows.append(dict(variant="cache-true (two passes)", ctx=ctx, k=k, recompute=rec, **summarize(mt)))
            print(rows[-1], flush=True)
            if k in engine_ks:
                eng = engine_scores(hf, tok, items, prompts, canonical, ctx, k)
                me = [metrics(it["ref"], lg) for it, lg in zip(items, eng)]
                diff = max(float((x - y).abs().max()) for x, y in zip(true, eng))
                rows.append(dict(variant="engine", ctx=ctx, k=k, recompute=rec, max_abs_logit_diff_vs_cache_true=diff,
                                 **summarize(me)))
                print(rows[-1], flush=True)
    print(f"\n{len(items)} prompts, {rows[0]['tokens']} answer tokens; {time.perf_counter() - t0:.0f}s\n")
    print("| variant | chunk context | first k | recomputed chunk tokens | top-1 agree | KL nats/tok |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['variant']} | {r['ctx']} | {'-' if r['k'] is None else r['k']} | {100 * r['recompute']:.1f}% | "
              f"{100 * r['top1']:.1f}% | {r['kl']:.4f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d"), argv=argv or sys.argv[1:], rows=rows), f, indent=2)
    return rows


if __name__ == "__main__":
    main()
