"""Train a learned chunk packet for a model (default: the embedded SmolLM2-135M-Instruct) and
measure its fidelity on held-out cases.

Training data: fictional encyclopedia entries from templates (benchmarks/packet_corpus.py),
split by document into training cases and held-out synthetic cases. Fidelity: the report of
``lazyllm.quality.compare`` (full attention as the reference) on ``--eval`` (default: the
hand-written held-out cases, tests/data/quality_heldout.jsonl, never trained on), for the
default setting without a packet, with the packet alone, and with the packet plus recompute.

    python benchmarks/packets.py --k-header 4 --k-trailer 4 --cases 120 --minutes 20 \\
        --out lazyllm/model/packet_files/smollm2-135m-instruct.safetensors --json packets.json
    python benchmarks/packets.py --eval-only PACKET.safetensors       # the report alone

The shipped packet was trained on the real-prose suite's train split, judged on its test split
(docs/fidelity.md, "Packets"), on one H100 in about 45 s:

    python benchmarks/packets.py --train-cases benchmarks/data/prose/train.jsonl --k-header 8 \
        --k-trailer 8 --steps 600 --bf16 0 --device cuda --eval benchmarks/data/prose/test.jsonl \
        --recompute '' --out lazyllm/model/packet_files/smollm2-135m-instruct.safetensors
    # --teacher-orders 4: the order-mean teacher (measured: no better)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.packet_corpus import synthetic_cases  # noqa: E402
from lazyllm import LazyLLM  # noqa: E402
from lazyllm.model.packets import load_packets  # noqa: E402
from lazyllm.quality import compare  # noqa: E402
from lazyllm.quality.packet_training import build_cases, mean_loss, train_packets  # noqa: E402


def eval_settings(path: str, recompute: list[float]) -> list[tuple[str, dict]]:
    iso = {"quality": "isolated"}  # the layout packets are trained for
    out = [("no packet", {**iso, "packets": None}), ("packet", {**iso, "packets": path})]
    for r in recompute:
        out.append((f"packet + recompute {r:g}", {**iso, "packets": path, "recompute_ratio": r,
                                                  "recompute_selection": "attention"}))
        out.append((f"no packet + recompute {r:g}", {**iso, "packets": None, "recompute_ratio": r,
                                                     "recompute_selection": "attention"}))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--k-header", type=int, default=4)
    ap.add_argument("--k-trailer", type=int, default=4)
    ap.add_argument("--cases", type=int, default=120, help="training cases")
    ap.add_argument("--train-cases", default=None, help="a JSONL of cases to train on instead of the synthetic ones "
                    "(e.g. benchmarks/data/prose/train.jsonl)")
    ap.add_argument("--teacher-orders", type=int, default=0, help="0: full attention in the case's order; K: the "
                    "order-mean over it and K other orders")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--heldout-cases", type=int, default=12, help="synthetic held-out cases (other documents)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--minutes", type=float, default=20.0, help="training time limit")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--question-sees-header", type=int, default=1)
    ap.add_argument("--bf16", type=int, default=1, help="bfloat16 autocast for training on CPU")
    ap.add_argument("--out", default="packet.safetensors")
    ap.add_argument("--eval", default=os.path.join(ROOT, "tests/data/quality_heldout.jsonl"))
    ap.add_argument("--recompute", default="0.05,0.1")
    ap.add_argument("--eval-only", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-report", action="store_true", help="skip the fidelity report (losses only)")
    ap.add_argument("--cases-cache", default=None, help="a file keeping the teacher's cases between runs")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    res: dict = dict(args=vars(a), threads=torch.get_num_threads(), load=os.getloadavg())
    path = a.eval_only
    full = LazyLLM(a.model, device=a.device, reuse="none", kv_cache_bytes=256 << 20, progress=False, packets=None,
                   dtype="float32")
    if path is None:
        if a.train_cases:
            from lazyllm.quality import load_cases

            train_items = [dict(question=c.question, documents=list(c.documents), system=c.system,
                                doc_ids=list(c.documents)) for c in load_cases(a.train_cases)]
        else:
            train_items = synthetic_cases(a.cases, seed=0)
        held_items = synthetic_cases(a.heldout_cases, seed=1, doc_offset=10**6)  # another document pool
        t0 = time.perf_counter()
        if a.cases_cache and os.path.exists(a.cases_cache):
            train, held = torch.load(a.cases_cache, weights_only=False)
        else:
            train = build_cases(full, train_items, teacher_orders=a.teacher_orders)
            held = build_cases(full, held_items)
            if a.cases_cache:
                torch.save((train, held), a.cases_cache)
        res["teacher_s"] = time.perf_counter() - t0
        ap_kw = dict(k_header=a.k_header, k_trailer=a.k_trailer, steps=a.steps, lr=a.lr,
                     question_sees_header=bool(a.question_sees_header),
                     autocast=torch.bfloat16 if a.bf16 else None, time_limit_s=a.minutes * 60)
        packets, log = train_packets(full.hf_model, full.tokenizer, train, **ap_kw)
        packets.info.update(train_cases=len(train), train_documents=len({d for it in train_items
                                                                          for d in it["doc_ids"]}),
                            corpus=a.train_cases or "benchmarks/packet_corpus.py", teacher_orders=a.teacher_orders,
                            seconds=round(log["seconds"], 1))
        path = str(packets.save(a.out))
        qsh = bool(a.question_sees_header)
        res.update(train_seconds=log["seconds"], steps=log["steps"], losses=log["losses"],
                   heldout_synthetic_loss_before=mean_loss(full.hf_model, held, None),
                   heldout_synthetic_loss_after=mean_loss(full.hf_model, held, packets.rows, a.k_header, qsh),
                   heldout_synthetic_loss_other_mask=mean_loss(full.hf_model, held, packets.rows, a.k_header,
                                                               not qsh))
        print(json.dumps({k: v for k, v in res.items() if k != "losses"}, default=str), flush=True)
    if a.no_report:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1, default=str)
        return res
    rec = [float(x) for x in a.recompute.split(",") if x]
    report = compare(full, a.eval, settings=eval_settings(path, rec), progress=True)
    res["report"] = [{k: v for k, v in r.items() if k not in ("kwargs",)} for r in report.rows]
    print(report.to_markdown(), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    full.close()
    _ = load_packets(path)
    return res


if __name__ == "__main__":
    main()
