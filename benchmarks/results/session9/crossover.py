"""Where the Gluon prefill overtakes the Triton prefill (session 9): both kernels, RoPE on and off,
on varlen batches from 8 x 512 tokens over themselves to 2048 queries over 8k keys. Run from the
repository root on a Hopper GPU: python3 benchmarks/results/session9/crossover.py"""
import sys, os, torch
sys.path.insert(0, "benchmarks")
from kernel_variants import _load
kb = _load(os.path.join(os.getcwd(), "benchmarks/kernels.py"), "_kb")
from lazyllm.kernels import triton_attention as ta
inv = kb.llama3_inv_freq().cuda()
for batch, kv, nq in [(8, 512, 512), (4, 1024, 1024), (1, 4163, 4163), (1, 8192, 2048), (2, 4096, 512)]:
    pg = kb.Paged(batch, kv, nq, 64, inv, seed=0, dev="cuda")
    q = torch.randn(batch * nq, kb.HQ, kb.D, device="cuda", dtype=torch.bfloat16)
    q_pos = torch.arange(kv - nq, kv, device="cuda").repeat(batch)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * nq
    a = pg.args(q, q_pos, cu)
    rt = ta.rope_table(pg.block_delta, inv)
    out = torch.empty_like(q)
    f = {k: (lambda pk=pk, r=r: ta.paged_attention_triton(**a, out=out, max_seqlen_q=nq, rope=rt if r else None, use_rope=r, padding_finite=True, prefill_kernel=pk))
         for k, pk, r in [("gl", "gluon", True), ("gl_off", "gluon", False), ("tl", "triton", True), ("tl_off", "triton", False), ("auto", None, True)]}
    for v in f.values(): v()
    torch.cuda.synchronize()
    o1 = f["gl"]().clone(); o2 = f["tl"]().clone()
    err = ((o1.float() - o2.float()).norm() / o2.float().norm()).item()
    t = {k: min(kb.bench(v) for _ in range(2)) for k, v in f.items()}
    print(f"batch {batch} q={nq} kv={kv}: gluon {t['gl']:.4f} (off {t['gl_off']:.4f}, {100*(t['gl']/t['gl_off']-1):+.1f}%) "
          f"triton {t['tl']:.4f} (off {t['tl_off']:.4f}, {100*(t['tl']/t['tl_off']-1):+.1f}%) auto {t['auto']:.4f} | gl/tl {t['gl']/t['tl']:.2f} | diff {err:.1e}", flush=True)
