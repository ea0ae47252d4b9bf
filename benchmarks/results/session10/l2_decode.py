"""Decode b64 over ~4.2k keys: flat vs rotary halves, warm L2 vs L2 flushed between calls
(a 512 MB copy in the same graph), and a 32-layer-like chain of distinct caches."""
import importlib.util, sys, torch, triton
spec = importlib.util.spec_from_file_location("kb", "benchmarks/kernels.py")
kb = importlib.util.module_from_spec(spec); sys.argv = ["x"]; spec.loader.exec_module(kb)
ta = kb.ta
dev = "cuda"
inv = kb.llama3_inv_freq().to(dev)
B, KV = 64, 4224
pgs = [kb.Paged(B, KV, 16, 64, inv, seed=s, dev=dev) for s in range(4)]
torch.manual_seed(3)
q = torch.randn(B, kb.HQ, kb.D, device=dev, dtype=kb.DTYPE)
qp = torch.full((B,), KV - 1, device=dev, dtype=torch.int64)
cu = torch.arange(B + 1, device=dev, dtype=torch.int32)
out = torch.empty_like(q)
big_a = torch.empty(256 * 2**20, device=dev, dtype=torch.uint16); big_b = torch.empty_like(big_a)
rts = [ta.rope_table(p.block_delta, inv) for p in pgs]
def call(i, mode, rope=True):
    ta._SHORT_HALVES = mode
    a = pgs[i].args(q, qp, cu)
    kw = dict(rope=rts[i]) if rope else dict(use_rope=False)
    ta.paged_attention_triton(**a, out=out, max_seqlen_q=1, **kw)
for mode in ("0", "64", "32"):
    for i in range(4): call(i, mode); call(i, mode, False)
torch.cuda.synchronize()
g = lambda f: triton.testing.do_bench_cudagraph(f, rep=60, return_mode="median")
flush = g(lambda: big_b.copy_(big_a))
print(f"flush copy alone {flush*1e3:.1f} us")
for rope in (True, False):
    for mode in ("0", "64", "32", "0"):
        warm = g(lambda: call(0, mode, rope))
        cold = g(lambda: (big_b.copy_(big_a), call(0, mode, rope))) - flush
        chain = g(lambda: [call(i, mode, rope) for i in range(4)]) / 4
        print(f"rope={rope} SHORT_HALVES={mode}: warm {warm*1e3:.1f} us  after-flush {cold*1e3:.1f} us  4-cache chain {chain*1e3:.1f} us/call", flush=True)
