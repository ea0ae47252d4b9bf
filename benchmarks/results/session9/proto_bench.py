"""Session 9 prototype bench: copies of gluon_prefill.py side by side with the Triton prefill and SDPA.
args: path:tag:BLOCK_M:warps:stages ...  Everything compiles on a small case first; then each shape
times every function twice, round robin, and keeps the min."""
import sys, os, time, json
import torch
ROOT = os.getcwd()
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from kernel_variants import _load
kb = _load(os.path.join(ROOT, "benchmarks/kernels.py"), "_kb")
import importlib.util as _u
import lazyllm.kernels  # noqa
from lazyllm.kernels import triton_attention as ta
def _mod(path, name):
    sp = _u.spec_from_file_location("lazyllm.kernels." + name, path); m = _u.module_from_spec(sp); sp.loader.exec_module(m); return m
inv = kb.llama3_inv_freq().cuda()
V = []
for i, a in enumerate(sys.argv[1:]):
    parts = a.split(':')
    path, tag, bm, nw, st = parts[:5]
    if len(parts) > 5:
        for kv in parts[5].split(','):
            k, v = kv.split('='); os.environ[k] = v
    V.append((_mod(path, f'glm{i}'), f"{tag}_{bm}x{nw}s{st}", (int(bm), int(nw), int(st))))
SHAPES = [(512, 4096), (512, 8192), (512, 32768), (2048, 4096), (2048, 8192), (2048, 32768)]
if os.environ.get("SHAPES"):
    SHAPES = [tuple(int(x) for x in s.split("/")) for s in os.environ["SHAPES"].split(",")]
out_dir = os.environ.get("OUT", "/tmp")
rows = []
first = True
for nq, kv in SHAPES:
    pg, qs, q, q_pos, cu = kb.prefill_case(nq, kv, 64, inv, "cuda")
    a = pg.args(q, q_pos, cu)
    rt = ta.rope_table(pg.block_delta, inv)
    s_out = kb.sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True)
    out = torch.empty_like(q)
    fns = {"tl_rope": lambda: ta.paged_attention_triton(**a, out=out, max_seqlen_q=nq, rope=rt),
           "tl_off": lambda: ta.paged_attention_triton(**a, out=out, max_seqlen_q=nq, use_rope=False),
           "sdpa": lambda: kb.sdpa_flash(qs, pg.k_sdpa, pg.v_sdpa, True)}
    r = dict(q=nq, kv=kv)
    for gp, tag, cfg in V:
        def mk(rope, gp=gp, cfg=cfg):
            return lambda: gp.paged_prefill_gluon(**a, out=out, max_seqlen_q=nq, runs=rt[2], padding_finite=True, config=cfg, use_rope=rope)
        try:
            out.fill_(float("nan")); mk(True)(); torch.cuda.synchronize()
            e_ref, e_sdpa = kb.check_prefill(pg, qs, q, q_pos, cu, out, s_out)
            r[tag + "_err"] = e_ref; r[tag + "_nan"] = bool(torch.isnan(out).any())
            mk(False)(); torch.cuda.synchronize()
            fns[tag + "_rope"] = mk(True); fns[tag + "_off"] = mk(False)
            if os.environ.get("PB_DIAG"):
                a1 = dict(a, block_delta=torch.zeros_like(a["block_delta"]))
                rt1 = ta.rope_table(a1["block_delta"], inv)
                fns[tag + "_one"] = (lambda gp=gp, cfg=cfg, a1=a1, rt1=rt1: gp.paged_prefill_gluon(**a1, out=out, max_seqlen_q=nq, runs=rt1[2], padding_finite=True, config=cfg, use_rope=True))
        except Exception as e:
            r[tag + "_error"] = repr(e)[:400]; print(f"{nq}/{kv} {tag}: ERROR {e!r:.400}", flush=True)
    for f in fns.values(): f()
    torch.cuda.synchronize()
    if first:  # clocks up after the compiles
        t0 = time.time()
        while time.time() - t0 < 3: fns["tl_rope"]()
        torch.cuda.synchronize(); first = False
    ts = {k: [] for k in fns}
    for rep in range(2):
        for k, f in fns.items(): ts[k].append(kb.bench(f))
    for k, v in ts.items(): r[k] = min(v); r[k + "_spread"] = max(v) / min(v) - 1
    line = f"{nq}/{kv}: tl {r['tl_rope']:.4f} off {r['tl_off']:.4f} ({100*(r['tl_rope']/r['tl_off']-1):+.1f}%) sdpa {r['sdpa']:.4f}"
    print(line, flush=True)
    for gp, tag, cfg in V:
        if tag + "_rope" in r:
            print(f"   {tag}: rope {r[tag+'_rope']:.4f} off {r[tag+'_off']:.4f} cost {100*(r[tag+'_rope']/r[tag+'_off']-1):+.1f}% "
                  f"| vs tl {r[tag+'_rope']/r['tl_rope']:.3f}x | sdpa/gl {r['sdpa']/r[tag+'_rope']:.2f} | err {r[tag+'_err']:.1e} nan {r[tag+'_nan']} "
                  f"| spread {100*r[tag+'_rope_spread']:.1f}/{100*r[tag+'_off_spread']:.1f}%" + (f" | one-run {100*(r[tag+'_one']/r[tag+'_off']-1):+.1f}%" if tag + '_one' in r else ""), flush=True)
    rows.append(r)
    json.dump(rows, open(os.path.join(out_dir, "pb_%s.json" % os.environ.get("TAG", "x")), "w"), indent=1)
    del pg, fns
    torch.cuda.empty_cache()
