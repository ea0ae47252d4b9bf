"""Times copies of kernels/gluon_prefill.py side by side with the Triton prefill and SDPA
(the session 8 prototype rounds). Run from the repository root on a Hopper GPU:

    patch -o /tmp/gl_v7.py kernels/gluon_prefill.py benchmarks/results/session8/gluon_overlap/gl_v7_pingpong.diff
    python3 benchmarks/results/session8/gluon_proto_bench.py kernels/gluon_prefill.py:v3:128:8:2 /tmp/gl_v7.py:v7:128:4:2

Each argument is path:tag:BLOCK_M:warps:stages. Note: the first shape is timed right after
the compiles (clocks low); benchmarks/gluon_prefill.py warms up first.
"""
import sys, os, time, json, traceback
sys.argv = [sys.argv[0]] + sys.argv[1:]
import torch, triton
ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import kernels as kb
import importlib.util as _u
def _mod(path, name):
    # a submodule of lazyllm.kernels, so the copy's relative imports (.triton_attention) resolve
    import lazyllm.kernels  # noqa: F401
    sp = _u.spec_from_file_location("lazyllm.kernels." + name, path); m = _u.module_from_spec(sp); sp.loader.exec_module(m); return m
from lazyllm.kernels import triton_attention as ta
inv = kb.llama3_inv_freq().cuda()
CFGS = []
for i, a in enumerate(sys.argv[1:]):
    path, ver, bm, nw, st = a.split(':')
    CFGS.append((_mod(path, f'glmod{i}'), ver, int(bm), int(nw), int(st)))
rows = []
out_dir = os.environ.get("OUT", "/tmp")
for nq, kv in [(512, 4096), (2048, 32768), (512, 8192), (512, 32768), (2048, 4096), (2048, 8192)]:
    pg, qs, q, q_pos, cu = kb.prefill_case(nq, kv, 64, inv, "cuda")
    a = pg.args(q, q_pos, cu)
    rt = ta.rope_table(pg.block_delta, inv)
    s_out = kb.sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True)
    out = torch.empty_like(q)
    r = dict(q=nq, kv=kv)
    r["tl_rope"] = kb.bench(lambda: ta.paged_attention_triton(**a, out=out, max_seqlen_q=nq, rope=rt))
    r["tl_off"] = kb.bench(lambda: ta.paged_attention_triton(**a, out=out, max_seqlen_q=nq, use_rope=False))
    r["sdpa"] = kb.bench(lambda: kb.sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True))
    for gp, ver, bm, nw, st in CFGS:
        tag = f"gl{ver}_{bm}x{nw}s{st}"
        try:
            t0 = time.time()
            out.fill_(float("nan"))
            gp.paged_prefill_gluon(**a, out=out, max_seqlen_q=nq, runs=rt[2], padding_finite=True, config=(bm, nw, st))
            torch.cuda.synchronize()
            e_ref, e_sdpa = kb.check_prefill(pg, qs, q, q_pos, cu, out, s_out)
            r[tag + "_err_ref"], r[tag + "_err_sdpa"], r[tag + "_nan"] = e_ref, e_sdpa, bool(torch.isnan(out).any())
            r[tag + "_rope"] = kb.bench(lambda: gp.paged_prefill_gluon(**a, out=out, max_seqlen_q=nq, runs=rt[2], padding_finite=True, config=(bm, nw, st)))
            r[tag + "_off"] = kb.bench(lambda: gp.paged_prefill_gluon(**a, out=out, max_seqlen_q=nq, runs=rt[2], padding_finite=True, config=(bm, nw, st), use_rope=False))
            print(f"{nq}/{kv} {tag}: err ref {e_ref:.1e} sdpa {e_sdpa:.1e} nan {r[tag + '_nan']} | rope {r[tag + '_rope']:.4f} off {r[tag + '_off']:.4f} "
                  f"cost {100 * (r[tag + '_rope'] / r[tag + '_off'] - 1):+.1f}% | tl rope {r['tl_rope']:.4f} off {r['tl_off']:.4f} sdpa {r['sdpa']:.4f} "
                  f"| gl/sdpa {r['sdpa'] / r[tag + '_rope']:.2f} ({time.time() - t0:.0f}s)", flush=True)
        except Exception as e:
            r[tag + "_error"] = repr(e)[:300]
            print(f"{nq}/{kv} {tag}: ERROR {e!r:.300}", flush=True)
    rows.append(r)
    json.dump(rows, open(os.path.join(out_dir, "gl_%s.json" % CFGS[0][1]), "w"), indent=1)
    del pg
    torch.cuda.empty_cache()
