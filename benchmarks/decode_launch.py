"""The engine's own decode attention call, recorded and replayed alone (issue 3 follow-up).

The rotary-halves short path (``LAZYLLM_SHORT_HALVES=auto``) ran decode at batch 32-128
3.5-7% faster than the flat loop in ``benchmarks/kernels.py``, yet made the engine's batch-64
decode step 16.1 ms against 11.9 ms (BENCHMARKS.md, session 10). The cause found since: the
engine's ``padding_finite=True`` sent those decode calls to the Gluon prefill (fixed in the
launcher). This script checks the engine's call against the benchmark's directly:

1. runs the engine as ``benchmarks/engine.py`` does (Llama-3.1-8B shapes, random bf16
   weights, 8 cached chunks of about 510 tokens, ``--batch`` requests) up to its first decode
   step at that batch, and records layer 0's attention call exactly as the engine makes it:
   the tensors with their strides (a table slice keeps its row stride), the table width, the
   step's extras (``rope`` tuple, ``padding_finite``);
2. prints what the call looks like (shapes, strides, used table entries, runs per row);
3. replays it alone from CUDA graphs under each short-path loop (``_SHORT_HALVES`` ``0``,
   ``auto``, ``64``, ``32``), as recorded and with one difference from kernels.py's call
   removed at a time: the query made contiguous, positions in int64, the tables cut to their used width and made
   contiguous, the ``rope`` tables rebuilt from those, the output contiguous, and all of these;
4. times the same variants in a chain over every layer's cache (as the engine's step reads
   32 different pools), to see whether the loss shows only with other layers between calls.

    python3 benchmarks/decode_launch.py --tokenizer .carry/tok [--batch 64] [--json out.json]
    python3 benchmarks/decode_launch.py --dry-run --tokenizer .carry/tok   # CPU, interpreter, tiny model
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as engine_bench  # noqa: E402  (benchmarks/engine.py: the model and the texts)


def keep(a):
    """A copy of ``a`` with the same shape and strides (a slice of a wider table stays one)."""
    if not torch.is_tensor(a):
        return a
    b = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
    b.copy_(a)
    return b


def describe(name, a):
    if torch.is_tensor(a):
        return f"{name}: {tuple(a.shape)} stride {tuple(a.stride())} {str(a.dtype)[6:]} contiguous={a.is_contiguous()}"
    if isinstance(a, tuple):
        return "\n".join(describe(f"{name}[{i}]", x) for i, x in enumerate(a))
    return f"{name}: {a!r}"


def record_call(llm, batch):
    """Layer 0's attention call at the first decode step of ``batch`` requests (not the
    graph capture itself: the eager warm-up call before it, or an eager step)."""
    model = llm.engine.model
    orig = model.attention
    rec = {}

    def spy(*args, **kw):
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if (not rec and not capturing and kw.get("max_seqlen_q") == 1 and args[0].shape[0] == batch
                and int(args[2].numel()) == batch + 1):
            rec["args"] = [a if i in (3, 4) else keep(a) for i, a in enumerate(args)]  # K/V: the pool views
            rec["kw"] = {k: tuple(keep(x) for x in v) if isinstance(v, tuple) else keep(v) for k, v in kw.items()}
        return orig(*args, **kw)

    model.attention = spy
    return rec, orig


def variants(args, kw, ta):
    """(name, args, kw): the engine's call, then one difference from kernels.py's removed at a time."""
    (q, pos, cu, kc, vc, bt, bpos, bdelta, blen, inv, scale) = args
    used = int((blen > 0).sum(dim=1).max())
    cut = [t[:, :used].contiguous() for t in (bt, bpos, bdelta, blen)]
    kw_cut = dict(kw, rope=ta.rope_table(cut[2], inv)) if "rope" in kw else dict(kw)
    out = []
    out.append(("as recorded", list(args), dict(kw)))
    out.append(("q contiguous", [q.contiguous()] + list(args[1:]), dict(kw)))
    out.append(("q_pos int64", [q, pos.long()] + list(args[2:]), dict(kw)))
    out.append(("tables contiguous, full width",
                [q, pos, cu, kc, vc] + [t.contiguous() for t in (bt, bpos, bdelta, blen)] + [inv, scale],
                dict(kw, rope=ta.rope_table(bdelta.contiguous(), inv)) if "rope" in kw else dict(kw)))
    out.append((f"tables cut to {used} entries", [q, pos, cu, kc, vc] + cut + [inv, scale], kw_cut))
    out.append(("all of the above", [q.contiguous(), pos.long(), cu, kc, vc] + cut + [inv, scale], kw_cut))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batch", type=int, default=None, help="requests decoding together (default 64; 3 dry)")
    ap.add_argument("--layers", type=int, default=None, help="default 32 (1 dry)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, a tiny model")
    args = ap.parse_args()
    batch = args.batch or (3 if DRY else 64)
    layers = args.layers or (1 if DRY else 32)

    import transformers
    from transformers import AutoTokenizer

    from lazyllm import LazyLLM
    from lazyllm.kernels import triton_kernels

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    if DRY:
        cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=256,
                                       num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                       head_dim=128, max_position_embeddings=4096)
        model = engine_bench.random_model(cfg, device="cpu", dtype=torch.float16)
        llm = LazyLLM(model=model, tokenizer=tok, device="cpu", attention_backend="triton", page_size=64,
                      kv_cache_bytes=64 << 20, progress=False)
        n_chunk, n_q = 70, 12
    else:
        cfg = engine_bench.llama31_8b_config(layers)
        model = engine_bench.random_model(cfg)
        llm = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=48 << 30, page_size=64)
        n_chunk, n_q = 510, 50
    ta = triton_kernels(interpret=DRY)
    llm.engine.eos_ids = set()
    chunks = [engine_bench.text_of_tokens(llm, n_chunk, seed=i) for i in range(8 if not DRY else 3)]
    question = engine_bench.text_of_tokens(llm, n_q, seed=99)
    reqs = [{"question": f"{b} {question}", "chunks": chunks} for b in range(batch)]
    llm.generate_batch(reqs[:1], max_new_tokens=2)  # chunks cached
    rec, orig = record_call(llm, batch)
    llm.generate_batch(reqs, max_new_tokens=8)  # all of them decode together within a few steps
    llm.engine.model.attention = orig
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies were made on the graph warm-up's side stream
    if not rec:
        raise SystemExit(f"no decode call at batch {batch} was seen")
    a, kw = rec["args"], rec["kw"]
    names = ["q", "q_pos", "cu_seqlens_q", "k_cache", "v_cache", "block_table", "block_pos", "block_delta",
             "block_len", "inv_freq", "sm_scale"]
    report = {"batch": batch, "layers": layers, "device": torch.cuda.get_device_name() if not DRY else "cpu (dry run)"}
    lines = [describe(n, x) for n, x in zip(names, a)] + [describe(k, v) for k, v in kw.items()]
    blen, bdelta = a[8], a[7]
    used = (blen > 0).sum(dim=1)
    runs = ((bdelta[:, 1:] != bdelta[:, :-1]) & (blen[:, 1:] > 0)).sum(dim=1) + 1
    lines.append(f"used entries per row: {used.min().item()}-{used.max().item()} of width {blen.shape[1]}; "
                 f"runs per row {runs.min().item()}-{runs.max().item()}; keys per row "
                 f"{blen.sum(dim=1).min().item()}-{blen.sum(dim=1).max().item()}; "
                 f"k_cache numel {a[3].numel()} (IDX64 {max(a[3].numel(), a[4].numel()) >= 2 ** 31})")
    pool = llm.engine.pool  # (layers, pages, page_size, kv heads, head_dim) K and V
    if pool.k.dim() != 5 or pool.k.shape[0] != layers or pool.k[0].data_ptr() != a[3].data_ptr():
        raise SystemExit(f"unexpected pool layout {tuple(pool.k.shape)}: the layer chain needs layer 0's view")
    lines.append(f"pool: K and V {tuple(pool.k.shape)} each")
    for ln in lines:
        print(ln, flush=True)
    report["call"] = lines

    # what the launcher compiles for each loop, then times: alone and over every layer's pool
    calls = []
    real = ta._paged_attn_fwd

    class Spy:
        def __getitem__(self, grid):
            launch = real[grid]

            def run(*p, **k):
                calls.append({"grid": list(grid), **{n: v for n, v in k.items() if isinstance(v, (int, bool, str))}})
                return launch(*p, **k)
            return run

    ref = None
    rows = []
    mode_before = ta._SHORT_HALVES
    for mode in ("0", "auto", "64", "32"):
        ta._SHORT_HALVES = mode
        for name, va, vkw in variants(a, kw, ta):
            out = torch.empty_like(va[0])
            ta._paged_attn_fwd = Spy()
            try:
                ta.paged_attention_triton(*va, out=out, **vkw)
            finally:
                ta._paged_attn_fwd = real
            launch = calls[-1] if calls else {"grid": None}
            if ref is None:
                ref = out.float().clone()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row = {"mode": mode, "variant": name, "err_vs_first": err, "launch": {
                k: launch.get(k) for k in ("grid", "QROT", "BLOCK_M", "BLOCK_N", "SCAN", "SPLIT_OUT", "FROM_DELTA",
                                           "PACKED_ROT", "IDX64", "num_warps", "num_stages")}}
            if not DRY:
                import triton.testing

                fn = lambda: ta.paged_attention_triton(*va, out=out, **vkw)  # noqa: E731
                row["ms"] = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")
                row["ms_again"] = triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")

                def chain(va=va, vkw=vkw, out=out):  # every layer's pool in turn, as a step reads them
                    for li in range(layers):
                        ta.paged_attention_triton(*va[:3], pool.k[li], pool.v[li], *va[5:], out=out, **vkw)
                row["ms_chain_per_layer"] = triton.testing.do_bench_cudagraph(chain, rep=60, return_mode="median") / layers
            rows.append(row)
            print(f"SHORT_HALVES={mode:4s} {name:32s} " + (
                f"{1e3 * min(row['ms'], row['ms_again']):7.1f} us alone, {1e3 * row['ms_chain_per_layer']:7.1f} us "
                f"a layer over {layers} pools " if "ms" in row else "")
                  + f"err {err:.1e} launch {row['launch']}", flush=True)
    ta._SHORT_HALVES = mode_before
    report["rows"] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
