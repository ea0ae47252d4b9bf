import torch, triton
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.nn.attention.bias import causal_lower_right
HQ, HKV, D = 32, 8, 128
for nq, kv in [(512, 4096), (512, 8192), (512, 32768), (2048, 4096), (2048, 8192), (2048, 32768)]:
    q = torch.randn(1, HQ, nq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HKV, kv, D, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    ke, ve = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    ref = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=True, scale=D**-0.5)[0]
    flops = 4 * HQ * D * (nq * (kv - nq) + nq * (nq + 1) / 2)
    for nm, kk, vv, gqa in (("gqa", k, v, True), ("expanded", ke, ve, False)):
        try:
            m = causal_lower_right(nq, kv)
            def f():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=m, enable_gqa=gqa)
            o = f(); torch.cuda.synchronize()
            err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            ms = triton.testing.do_bench(f)
            print(f"cudnn lower-right {nm} {nq}/{kv}: {ms:.4f} ms {flops/ms/1e9:.0f} TF err vs flash {err:.1e}", flush=True)
        except Exception as e:
            print(f"cudnn lower-right {nm} {nq}/{kv}: ERROR {repr(e)[:200]}", flush=True)
        try:
            def g():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=False, enable_gqa=gqa)
            g(); ms = triton.testing.do_bench(g)
            print(f"cudnn non-causal {nm} {nq}/{kv}: {ms:.4f} ms {4*HQ*D*nq*kv/ms/1e9:.0f} TF (full count)", flush=True)
        except Exception as e:
            print(f"cudnn non-causal {nm} {nq}/{kv}: ERROR {repr(e)[:200]}", flush=True)
