"""Learned chunk packets on one GPU, Llama-3.1-8B shapes with random bf16 weights (speed does
not depend on the values).

``ttft``: a request of 8 cached chunks of 510 tokens and a 50-token question, the chunks
warmed beforehand and rotated per timed request (the prompt of benchmarks/preset_ttft.py),
without a packet, with an 8 + 8 token packet (each cached chunk then holds 16 more tokens)
and with the same packet as a bridge packet (its 8 trailer tokens of every chunk recomputed
per request); the median TTFT and the median decode step (32 new tokens) of each.
``train``: packet training throughput: one Adam step of the differentiable student forward
and backward (transformers, 4-D mask, explicit positions) over a case of 4 chunks of 510
tokens, a question and a 16-token answer; tokens per second of student sequence, and the
teacher's forward (full attention, no gradient) on the same case. From these, the time to
adapt on 1M document tokens.

    python benchmarks/gpu_packets.py ttft  [--json ttft.json]
    python benchmarks/gpu_packets.py train [--json train.json]
    python benchmarks/gpu_packets.py ttft --tiny --device cpu        # smoke runs of the script
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks._common import (  # noqa: E402
    device_name,
    llama31_8b_config,
    load_tokenizer,
    random_model,
    run_to_length,
    shrink_to_tiny,
    text_of_tokens,
)
from lazyllm.model.identity import model_id  # noqa: E402
from lazyllm.model.llama import LlamaFamilyModel  # noqa: E402
from lazyllm.model.packets import Packets  # noqa: E402


def _setup(args):
    tok = load_tokenizer(args.tokenizer)
    cfg = llama31_8b_config(args.layers)
    if args.tiny:
        shrink_to_tiny(cfg, len(tok))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = random_model(cfg, device=args.device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    std = float(model.get_input_embeddings().weight.detach().float().std())
    mid = model_id(LlamaFamilyModel(model, fuse=False, fused_kernels=False))
    packets = Packets(torch.randn(8, cfg.hidden_size, generator=g) * std,
                      torch.randn(8, cfg.hidden_size, generator=g) * std, mid)
    return tok, cfg, model, packets


def run_ttft(args, tok, model, packets) -> list[dict]:
    from lazyllm import LazyLLM

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows, chunks, question = [], None, None
    system = "You answer from the documents."
    bridge = Packets(packets.header, packets.trailer, packets.model, bridge=True)
    for name, p in (("no packet", None), ("packet 8+8", packets), ("bridge 8+8", bridge), ("no packet (again)", None)):
        llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=(16 << 30) if cuda else (256 << 20), packets=p,
                      quality="isolated")
        run_to_length(llm)
        if chunks is None:
            chunks = [text_of_tokens(llm, args.chunk_tokens, seed=i) for i in range(args.chunks)]
            question = text_of_tokens(llm, 50, seed=99)
        llm.warm(chunks, system=system)
        llm.generate("warm-up " + question, chunks=chunks[:1], system=system, max_new_tokens=4)
        ttft, step = [], []
        for i in range(args.reps):
            order = chunks[i % len(chunks):] + chunks[:i % len(chunks)]
            sync()
            t0 = time.perf_counter()
            out = llm.generate(f"{i} {question}", chunks=order, system=system, max_new_tokens=args.decode_tokens)
            total = time.perf_counter() - t0
            ttft.append(out.ttft_s)
            step.append((total - out.ttft_s) / max(1, len(out.token_ids) - 1))
        chunk_tokens = sum(len(ids) for k, ids in out.prompt_segments if k == "chunk")
        row = dict(setting=name, ttft_ms=statistics.median(ttft) * 1e3, ttft_all_ms=[t * 1e3 for t in ttft],
                   decode_step_ms=statistics.median(step) * 1e3, chunk_tokens=chunk_tokens,
                   cached_tokens=out.usage.cached_tokens)
        rows.append(row)
        print(f"{name:>18}: TTFT (from the call) {row['ttft_ms']:8.2f} ms  "
              f"decode step {row['decode_step_ms']:6.2f} ms  "
              f"chunk tokens {chunk_tokens}", flush=True)
        llm.close()
    return rows


def run_train(args, tok, model, packets) -> dict:
    from lazyllm.quality.packet_training import TrainCase, case_loss

    dev = torch.device(args.device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    segs = [("prefix", torch.randint(0, vocab, (40,), generator=g).tolist())]
    segs += [("chunk", torch.randint(0, vocab, (args.chunk_tokens,), generator=g).tolist()) for _ in range(4)]
    segs.append(("suffix", torch.randint(0, vocab, (60,), generator=g).tolist()))
    answer = torch.randint(0, vocab, (16,), generator=g).tolist()
    last = len(segs[-1][1]) + len(answer) - 1
    teacher = torch.log_softmax(torch.randn(last, vocab, generator=g), -1).half()
    case = TrainCase(segs, answer, teacher)
    for p in model.parameters():
        p.requires_grad_(False)
    rows = torch.nn.Parameter(packets.rows.to(dev))
    opt = torch.optim.Adam([rows], lr=1e-2)
    base = model.get_input_embeddings().weight.shape[0]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    per_chunk = packets.k_header + packets.k_trailer
    n_student = sum(len(s) for _, s in segs) + 4 * per_chunk + len(answer) - 1
    n_teacher = n_student - 4 * per_chunk

    def step():
        opt.zero_grad(set_to_none=True)
        case_loss(model, case, rows, packets.k_header, base).backward()
        opt.step()

    ids = torch.tensor([t for _, s in segs for t in s] + answer[:-1], device=dev)
    for _ in range(2):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    step_s = (time.perf_counter() - t0) / args.steps
    with torch.no_grad():
        model(input_ids=ids[None], use_cache=False, logits_to_keep=last)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            model(input_ids=ids[None], use_cache=False, logits_to_keep=last)
        sync()
        teacher_s = (time.perf_counter() - t0) / args.steps
    doc_tokens = 4 * args.chunk_tokens
    # 1M document tokens = 1M / doc_tokens cases, each one training step and one teacher forward
    # (the teacher's greedy answer adds 16 decode steps, not counted)
    per_m = 1e6 / doc_tokens * (step_s + teacher_s)
    res = dict(student_tokens=n_student, step_s=step_s, student_tokens_per_s=n_student / step_s,
               teacher_forward_s=teacher_s, teacher_tokens_per_s=n_teacher / teacher_s,
               adapt_1m_doc_tokens_s=per_m,
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None)
    print(json.dumps(res, indent=1), flush=True)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("ttft", "train"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small random Llama instead of 8B shapes (smoke run)")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=510)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5, help="timed training steps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tok, cfg, model, packets = _setup(args)
    res = dict(device=device_name(args.device),
               layers=cfg.num_hidden_layers, tiny=args.tiny)
    if args.what == "ttft":
        res["rows"] = run_ttft(args, tok, model, packets)
    else:
        res["train"] = run_train(args, tok, model, packets)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
