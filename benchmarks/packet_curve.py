"""Learned chunk packets: held-out fidelity against packet size, training data and a LoRA on
the chunk encoding, measured in the training harness (no engine round trip per point).

Every run trains from the same teacher cases (templated fictional documents,
benchmarks/packet_corpus.py, seed 0) for a fixed number of Adam steps and is measured on the
hand-written held-out cases (tests/data/quality_heldout.jsonl, never trained on): top-1
agreement and mean KL over the 16 answer tokens teacher-forced on full attention's greedy
answer, and "same answer" (the first 8 argmaxes equal full attention's tokens, which is the
same as the first 8 greedy tokens agreeing). These are the definitions of
``lazyllm.quality.compare``; ``--check PACKET`` prints both for one packet.

The LoRA (``--lora-rank``) is peft's LoRA on the attention and MLP projections, gated per
token so that it changes only the chunks' tokens (packet tokens included): the question and
the answer run on the unchanged model and read the chunks' adapted KV, which is what an
engine that applied the adapter only while encoding chunks would compute.

    python benchmarks/packet_curve.py --runs 0+4,4+0,2+2,4+4,8+8,16+16 --steps 120 --json curve.json
    python benchmarks/packet_curve.py --runs 8+8 --train-cases 20,40,80,160 --steps 120 --json curve.json
    python benchmarks/packet_curve.py --runs 0+0,8+8 --lora-rank 8 --steps 120 --json curve.json
    python benchmarks/packet_curve.py --model "$GEMMA" --runs 8+8 --train-cases 80 --json curve.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.packet_corpus import synthetic_cases  # noqa: E402
from lazyllm import LazyLLM  # noqa: E402
from lazyllm.quality.packet_training import (  # noqa: E402
    build_cases,
    init_packets,
    student_layout,
    student_logits,
    train_packets,
)

HELDOUT = os.path.join(ROOT, "tests/data/quality_heldout.jsonl")




class _Gate(torch.nn.Module):
    """Replaces peft's (identity) LoRA dropout: multiplies the adapter's input by the
    per-token gate, so the low-rank update reaches the chunk tokens only."""

    def __init__(self):
        super().__init__()
        self.gate: torch.Tensor | None = None

    def forward(self, x):
        return x if self.gate is None else x * self.gate.to(x.dtype)[None, :, None]


def add_lora(hf, rank: int, alpha: float | None = None):
    """peft LoRA on q/k/v/o and the MLP; returns (model, gates, trainable parameters)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=0.0,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    pm = get_peft_model(hf, cfg)
    gates = []
    for mod in pm.modules():
        if hasattr(mod, "lora_dropout") and "default" in getattr(mod, "lora_dropout", {}):
            g = _Gate()
            mod.lora_dropout["default"] = g
            gates.append(g)
    params = [p for n, p in pm.named_parameters() if "lora_" in n]
    return pm, gates, params


def logits(hf, case, rows, k_header, base, gates=(), last=None, bridge=False, deep=None, recompute=None):
    k_trailer = rows.shape[0] - k_header
    lay = student_layout(case.segments, case.answer, k_header, k_trailer, base, bridge=bridge, recompute=recompute)
    for g in gates:
        g.gate = lay.chunk_rows.float()
    inner = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    return student_logits(inner, lay.ids, lay.mask, rows, base, last or case.teacher_logp.shape[0],
                          positions=lay.positions, deep=deep, deep_rows=lay.bridge_rows, k_header=k_header)


def kl_loss(hf, case, rows, k_header, base, gates=()):
    logq = torch.log_softmax(logits(hf, case, rows, k_header, base, gates), -1)
    logp = case.teacher_logp.float()
    return (logp.exp() * (logp - logq)).sum(-1).mean()


@torch.no_grad()
def heldout(hf, cases, teacher32, rows, k_header, base, gates=(), same_n=8, bridge=False, deep=None, recompute=None):
    """compare()'s top-1, mean KL (over answer tokens) and same-answer rate; ``recompute``: per
    case, the chunk tokens recomputed (``engine_selections``)."""
    kls, agree, same = [], [], 0
    for i, (c, lp) in enumerate(zip(cases, teacher32)):
        q = logits(hf, c, rows, k_header, base, gates, last=len(c.answer), bridge=bridge, deep=deep,
                   recompute=recompute[i] if recompute is not None else None)
        lq = torch.log_softmax(q.double(), -1)
        lpd = lp.double()
        kls += (lpd.exp() * (lpd - lq)).sum(-1).clamp_min(0).tolist()
        agree += (lp.argmax(-1) == q.argmax(-1)).tolist()
        same += q.argmax(-1).tolist()[:same_n] == c.answer[:same_n]
    return dict(top1=sum(agree) / len(agree), kl=sum(kls) / len(kls), same=same, n=len(cases))


@torch.no_grad()
def llm_model(hf):
    from lazyllm.model.llama import LlamaFamilyModel

    return LlamaFamilyModel(hf, fuse=False, fused_kernels=False)


@torch.no_grad()
def teacher_f32(full, cases):
    """Full attention's float32 log-probabilities at the answer's positions (the cases keep
    float16 ones for training)."""
    out = []
    for c in cases:
        ids = [t for _, s in c.segments for t in s] + c.answer[:-1]
        lg = full.hf_model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=len(c.answer)).logits[0]
        out.append(torch.log_softmax(lg.float(), -1))
    return out


def train_lora(hf, cases, k_header, k_trailer, rank, steps, lr, lr_packet, tok, init=None, seed=0):
    """Adam on the gated LoRA (and the packet when it has rows); the model stays frozen."""
    base = int(hf.get_input_embeddings().weight.shape[0])
    for p in hf.parameters():
        p.requires_grad_(False)
    pm, gates, params = add_lora(hf, rank)
    for p in params:
        p.requires_grad_(True)
    rows0 = init if init is not None else (init_packets(hf, tok, k_header, k_trailer, seed) if k_header + k_trailer
                                           else torch.zeros(0, hf.config.hidden_size))
    rows = torch.nn.Parameter(rows0.clone().float())
    groups = [dict(params=params, lr=lr)] + ([dict(params=[rows], lr=lr_packet)] if rows.shape[0] else [])
    opt = torch.optim.Adam(groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / max(steps, 1))))
    rng, order, losses = random.Random(seed), [], []
    for _ in range(steps):
        if not order:
            order = list(range(len(cases)))
            rng.shuffle(order)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = kl_loss(pm, cases[order.pop()], rows, k_header, base, gates)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return pm, gates, rows.detach(), losses


def load_cases(full, path, n_train, corpus="synthetic"):
    """Teacher cases and their items (train, train items, held-out, held-out items, held-out
    float32 teacher), built once and kept in ``path``. ``corpus``: ``"synthetic"``
    (packet_corpus.py) or ``"mixture"`` (packet_mixture.py: installed documentation beside it)."""
    data = torch.load(path, weights_only=False) if path and os.path.exists(path) else {}
    with open(HELDOUT) as f:
        data["held_items"] = [json.loads(ln) for ln in f if ln.strip() and not ln.startswith("#")]
    if "held" not in data:
        data["held"] = build_cases(full, data["held_items"])
        data["held32"] = teacher_f32(full, data["held"])
    have = data.get("train", [])
    if "train_items" not in data and corpus == "synthetic":  # a cache from before items were kept
        data["train_items"] = synthetic_cases(len(have), seed=0)
    if len(have) < n_train:
        if corpus == "mixture":
            from benchmarks.packet_mixture import mixture_items

            items = mixture_items(full, n_train, seed=0)
        else:  # cases beyond the first 80 ask about other documents (80..n-1 of a larger pool)
            items = synthetic_cases(n_train, seed=0)
        data["train_items"] = data.get("train_items", []) + items[len(have):n_train]
        data["train"] = have + build_cases(full, items[len(have):n_train])
    if path:
        torch.save(data, path)
    return data["train"][:n_train], data["train_items"][:n_train], data["held"], data["held_items"], data["held32"]


def engine_selections(hf, tok, items, cases, packets, opts):
    """Per case, the chunk tokens (per chunk, indices in its ids with the packet) the engine's
    recovery recomputes when it scores the case's answer under ``opts`` (recompute options,
    isolated chunks) with ``packets``: what compare() measures, recorded from the engine."""
    llm = LazyLLM(model=hf, tokenizer=tok, packets=packets, kv_cache_bytes=256 << 20, progress=False, **opts,
                  quality="isolated")
    rec, got = llm.engine.recovery, []
    inner = rec.apply

    def apply(r):
        inner(r)
        plan = r.plan
        sel = [[] for _ in plan.spans]
        job = plan.job
        if job is not None and job.positions is not None and plan.spans:
            for p in job.positions[:len(job.positions) - len(plan.suffix_ids)]:
                for ci, sp in enumerate(plan.spans):
                    if sp.start <= p < sp.start + len(sp.ids):
                        sel[ci].append(p - sp.start)
                        break
        got.append(sel)

    rec.apply = apply
    out = []
    for it, c in zip(items, cases):
        got.clear()
        llm.score(it["question"], chunks=list(it["documents"]), system=it.get("system"), continuation=c.answer)
        out.append(got[0])
    llm.close()
    return out


def parse_recompute(spec):
    """``"first=4,ratio=0.14,selection=two-stage"`` -> LazyLLM recompute options."""
    if not spec:
        return None
    names = dict(first="recompute_first_tokens", ratio="recompute_ratio", selection="recompute_selection")
    out = {}
    for part in spec.split(","):
        k, v = part.split("=")
        out[names[k]] = int(v) if k == "first" else float(v) if k == "ratio" else v
    return out


def record(path, row):
    rows = []
    if path and os.path.exists(path):
        with open(path) as f:
            rows = json.load(f)
    rows.append(row)
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", default="8+8", help="header+trailer sizes, comma separated; 0+0 = no packet")
    ap.add_argument("--train-cases", default="80", help="training-set sizes, comma separated")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--lora-lr", type=float, default=1e-3)
    ap.add_argument("--cases-cache", default=None)
    ap.add_argument("--save", default=None, help="keep each trained packet here (a folder)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tag", default="")
    ap.add_argument("--check", default=None, help="measure this packet file only")
    ap.add_argument("--bridge", action="store_true", help="train the trailer as a bridge (recomputed per request)")
    ap.add_argument("--deep", action="store_true", help="with --bridge: also per-layer bridge parameters")
    ap.add_argument("--init", default=None, help="start from this packet file's header and trailer where their "
                                                 "sizes match the run's")
    ap.add_argument("--recompute", default=None,
                    help="measure with the engine's recovery, e.g. first=4,ratio=0.14,selection=two-stage")
    ap.add_argument("--in-loop", action="store_true", help="with --recompute: train under that recompute")
    ap.add_argument("--corpus", default="synthetic", choices=["synthetic", "mixture"],
                    help="training cases: packet_corpus.py, or packet_mixture.py (keep another --cases-cache)")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    full = LazyLLM(a.model, device="cpu", reuse="none", kv_cache_bytes=256 << 20, progress=False, packets=None,
                   quality="isolated")
    hf, tok = full.hf_model, full.tokenizer
    base = int(hf.get_input_embeddings().weight.shape[0])
    sizes = [int(x) for x in a.train_cases.split(",")]
    t0 = time.perf_counter()
    _, _, held, held_items, held32 = load_cases(full, a.cases_cache, max(sizes), a.corpus)
    opts = parse_recompute(a.recompute)
    model = os.path.basename(str(getattr(hf.config, "_name_or_path", "")).rstrip("/")) or "default"
    common = dict(model=model, tag=a.tag, heldout="tests/data/quality_heldout.jsonl", load=os.getloadavg())
    print(f"teacher cases: {time.perf_counter() - t0:.0f} s", flush=True)
    if a.check:
        from lazyllm.model.packets import load_packets

        p = load_packets(a.check)
        sel = engine_selections(hf, tok, held_items, held, p, opts) if opts else None
        record(a.json, dict(common, packet=f"{p.k_header}+{p.k_trailer}", file=a.check, bridge=p.bridge,
                            recompute=a.recompute,
                            **heldout(hf, held, held32, p.rows, p.k_header, base, bridge=p.bridge, recompute=sel)))
        return
    for n in sizes:
        train, train_items, _, _, _ = load_cases(full, a.cases_cache, n, a.corpus)
        for run in a.runs.split(","):
            kh, kt = (int(x) for x in run.split("+"))
            t1 = time.perf_counter()
            if a.lora_rank:
                pm, gates, rows, losses = train_lora(hf, train, kh, kt, a.lora_rank, a.steps, a.lora_lr, a.lr, tok)
                m = heldout(pm, held, held32, rows, kh, base, gates)
                hf = pm.unload()  # the plain model back for the next run
            elif kh + kt == 0:
                rows, losses = torch.zeros(0, hf.config.hidden_size), []
                m = heldout(hf, held, held32, rows, 0, base)
            else:
                from lazyllm.model.identity import model_id
                from lazyllm.model.packets import Packets, load_packets

                init = init_packets(hf, tok, kh, kt)
                if a.init:  # the file's header and trailer where their sizes match
                    f = load_packets(a.init)
                    if f.k_header == kh:
                        init[:kh] = f.header
                    if f.k_trailer == kt:
                        init[kh:] = f.trailer
                in_loop = None
                if opts and a.in_loop:  # the engine's selections under the starting packet
                    start = Packets(init[:kh], init[kh:], model_id(llm_model(hf)), bridge=a.bridge)
                    in_loop = engine_selections(hf, tok, train_items, train, start, opts)
                packets, log = train_packets(hf, tok, train, k_header=kh, k_trailer=kt, steps=a.steps, lr=a.lr,
                                             autocast=torch.bfloat16, progress=False, bridge=a.bridge,
                                             deep=a.deep, init=init, recompute=in_loop)
                rows, losses = packets.rows, log["losses"]
                sel = engine_selections(hf, tok, held_items, held, packets, opts) if opts else None
                m = heldout(hf, held, held32, rows, kh, base, bridge=a.bridge, deep=log.get("deep"), recompute=sel)
                if a.save:
                    os.makedirs(a.save, exist_ok=True)
                    kind = ("-deep" if a.deep else "") + ("-bridge" if a.bridge else "")
                    packets.save(os.path.join(a.save, f"{model}-{kh}+{kt}{kind}-n{n}-s{a.steps}.safetensors"))
            record(a.json, dict(common, packet=f"{kh}+{kt}", bridge=a.bridge, deep=a.deep, init=a.init,
                                recompute=a.recompute, in_loop=a.in_loop, corpus=a.corpus,
                                lora_rank=a.lora_rank, train_cases=n,
                                steps=a.steps if kh + kt or a.lora_rank else 0,
                                train_s=round(time.perf_counter() - t1, 1),
                                loss_last20=sum(losses[-20:]) / max(1, len(losses[-20:])), **m,
                                uptime=os.getloadavg()))
    full.close()


if __name__ == "__main__":
    main()
