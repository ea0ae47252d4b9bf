"""``kernel_bench.py``'s figures from its rows (rates, ratios, the fastest of repeated
readings) and its ``kernels.md`` tables."""
from __future__ import annotations

from benchmarks.attention import HQ, D


def _fastest(r, readings):
    """The fastest of the row's readings ``(name, key)`` that it holds, as ``(name, ms)``;
    ``None`` where it holds none."""
    held = [(name, r[key]) for name, key in readings if r.get(key)]
    return min(held, key=lambda x: x[1]) if held else None


def _rates(r, work: str, unit: str) -> None:
    """What prefill and decode rows share, into ``r``: ``r[work]`` (FLOPs or bytes) per second
    of each timed kernel as ``<unit>_rope`` / ``_norope`` / ``_sdpa`` (in 1e12 a second), the
    ratio to SDPA, and RoPE's cost over the kernel without it."""
    r[f"{unit}_rope"] = r[work] / r["ms_rope"] / 1e9
    r[f"{unit}_norope"] = r[work] / r["ms_norope"] / 1e9
    if r.get("ms_sdpa"):
        r[f"{unit}_sdpa"] = r[work] / r["ms_sdpa"] / 1e9
        r["vs_sdpa"] = r["ms_sdpa"] / r["ms_rope"]
    r["rope_cost"] = r["ms_rope"] / r["ms_norope"] - 1
    r["rope_cost_pretable"] = r["ms_rope_pretable"] / r["ms_norope"] - 1


def _prefill_figures(r) -> None:
    """A prefill row's rates and ratios, into ``r``."""
    _rates(r, "flops", "tflops")
    if r.get("ms_sdpa"):
        r["vs_sdpa_pretable"] = r["ms_sdpa"] / r["ms_rope_pretable"]
    if r.get("ms_triton_pretable"):
        r["triton_rope_cost"] = r["ms_triton_pretable"] / r["ms_triton_norope"] - 1
        r["vs_triton"] = r["ms_triton_pretable"] / r["ms_rope_pretable"]
    if r.get("ms_cudnn"):
        r["tflops_cudnn"] = r["flops"] / r["ms_cudnn"] / 1e9
        r["tflops_cudnn_nomask"] = 4 * HQ * D * r["q"] * r["kv"] / r["ms_cudnn_nomask"] / 1e9
    if r.get("ms_rope_graph"):
        # ours as the engine runs it, against the strongest baseline of the row: the fastest
        # reading of a causal SDPA backend (flash from a graph or do_bench, cuDNN causal), and
        # cuDNN's unmasked kernel by FLOP rate (ours on the causal pairs, it on all pairs)
        r["tflops_rope_graph"] = r["flops"] / r["ms_rope_graph_min"] / 1e9
        best = _fastest(r, (("flash, graph", "ms_sdpa_graph"), ("flash, do_bench", "ms_sdpa"),
                            ("cuDNN causal, graph", "ms_cudnn_graph"), ("cuDNN causal", "ms_cudnn")))
        if best:
            r["best_causal_sdpa"], r["ms_best_causal_sdpa"] = best
            r["vs_best_causal_sdpa"] = r["ms_best_causal_sdpa"] / r["ms_rope_graph_min"]
        # cuDNN unmasked: its faster reading (a graph keeps a small problem's K/V in L2
        # between replays, as ours; do_bench flushes L2)
        nomask = _fastest(r, (("graph", "ms_cudnn_nomask_graph"), ("do_bench", "ms_cudnn_nomask")))
        if nomask:
            r["ms_cudnn_nomask_best"] = nomask[1]
            r["tflops_cudnn_nomask_best"] = 4 * HQ * D * r["q"] * r["kv"] / nomask[1] / 1e9
            r["rate_vs_cudnn_nomask"] = r["tflops_rope_graph"] / r["tflops_cudnn_nomask_best"]


def _decode_figures(r) -> None:
    """A decode row's bandwidths and ratios, into ``r``."""
    _rates(r, "bytes", "tbs")
    if r.get("ms_rope_graph"):
        r["tbs_rope_graph"] = r["bytes"] / r["ms_rope_graph_min"] / 1e9
        if r.get("ms_sdpa_graph"):
            r["tbs_sdpa_graph"] = r["bytes"] / r["ms_sdpa_graph"] / 1e9
        # the strongest SDPA backend of the row: flash (FA2) or cuDNN, both from CUDA graphs
        if r.get("ms_cudnn_graph"):
            r["ms_cudnn_graph_min"] = min(r["ms_cudnn_graph"], r.get("ms_cudnn_graph2", r["ms_cudnn_graph"]))
        best = _fastest(r, (("flash", "ms_sdpa_graph"), ("cuDNN", "ms_cudnn_graph_min")))
        if best:
            r["best_sdpa"], r["ms_best_sdpa_graph"] = best
            r["tbs_best_sdpa_graph"] = r["bytes"] / r["ms_best_sdpa_graph"] / 1e9
            r["vs_best_sdpa_graph"] = r["ms_best_sdpa_graph"] / r["ms_rope_graph_min"]


def derived(row):
    """``row`` with its derived figures: rates, RoPE costs, ratios to the baselines."""
    r = dict(row)
    if "error" in r:
        return r
    if r["kind"] in ("prefill", "decode") and r.get("ms_rope_graph"):
        # the lower of the two interleaved readings of each side (older rows hold one)
        r["ms_rope_graph_min"] = min(r["ms_rope_graph"], r.get("ms_rope_graph2", r["ms_rope_graph"]))
        r["ms_norope_graph_min"] = min(r["ms_norope_graph"], r.get("ms_norope_graph2", r["ms_norope_graph"]))
        r["rope_cost_graph"] = r["ms_rope_graph_min"] / r["ms_norope_graph_min"] - 1
        if r.get("ms_sdpa_graph"):
            r["vs_sdpa_graph"] = r["ms_sdpa_graph"] / r["ms_rope_graph_min"]
    if r["kind"] == "prefill" and "ms_rope" in r:
        _prefill_figures(r)
    if r["kind"] == "decode" and "ms_rope" in r:
        _decode_figures(r)
    if r["kind"] == "rerotate" and "ms" in r:
        r["tbs"] = r["bytes"] / r["ms"] / 1e9
        r["tbs_torch_copy"] = r["bytes"] / r["ms_torch_copy"] / 1e9
        r["tbs_ref"] = r["bytes"] / r["ms_ref"] / 1e9
        r["vs_copy"] = r["ms_torch_copy"] / r["ms"]
    return r


def fmt_row(row):
    """One log line for a row."""
    r = derived(row)
    nan = float("nan")
    if "error" in r:
        return f"{r['kind']} {r.get('q', r.get('batch'))}/{r.get('kv')} ERROR {r['error']}"
    if r["kind"] == "prefill":
        line = (f"prefill q={r['q']:5d} kv={r['kv']:6d} | ours {r['ms_rope']:.3f} ms {r['tflops_rope']:.0f} TF/s | "
                f"rope-off {r['ms_norope']:.3f} | sdpa {r.get('ms_sdpa', nan):.3f} ms "
                f"{r.get('tflops_sdpa', nan):.0f} TF/s | x{r.get('vs_sdpa', nan):.2f} | "
                f"rope +{100 * r['rope_cost']:.1f}% (pretable +{100 * r['rope_cost_pretable']:.1f}%) | "
                f"err ref {r.get('err_ref', nan):.1e} sdpa {r.get('err_sdpa', nan):.1e} nan={r['nan']} | "
                f"{r.get('kernel')}")
        if r.get("ms_triton_pretable"):
            line += (f" | triton {r['ms_triton_pretable']:.3f} ms (x{r['vs_triton']:.2f} of it), its rope "
                     f"+{100 * r['triton_rope_cost']:.1f}%")
        if r.get("ms_rope_graph"):
            line += (f" | graph: ours {r['ms_rope_graph']:.4f}/{r['ms_rope_graph2']:.4f} ms rope-off "
                     f"{r['ms_norope_graph']:.4f}/{r['ms_norope_graph2']:.4f} sdpa {r.get('ms_sdpa_graph', nan):.4f} "
                     f"x{r.get('vs_sdpa_graph', nan):.2f} rope {100 * r['rope_cost_graph']:+.1f}%")
        return line
    if r["kind"] == "decode":
        line = (f"decode  b={r['batch']:4d} kv={r['kv']:6d} | ours {r['ms_rope']:.3f} ms {r['tbs_rope']:.2f} TB/s | "
                f"rope-off {r['ms_norope']:.3f} | sdpa {r.get('ms_sdpa', nan):.3f} ms "
                f"{r.get('tbs_sdpa', nan):.2f} TB/s | x{r.get('vs_sdpa', nan):.2f} | "
                f"rope +{100 * r['rope_cost']:.1f}% (pretable +{100 * r['rope_cost_pretable']:.1f}%) | "
                f"err ref {r['err_ref']:.1e} sdpa {r.get('err_sdpa', nan):.1e} nan={r['nan']}")
        if r.get("ms_rope_graph"):
            line += (f" | graph: ours {r['ms_rope_graph_min']:.3f} ms {r['tbs_rope_graph']:.2f} TB/s "
                     f"sdpa {r.get('ms_sdpa_graph', nan):.3f} x{r.get('vs_sdpa_graph', nan):.2f} "
                     f"cudnn {r.get('ms_cudnn_graph_min', nan):.3f} best {r.get('best_sdpa')} "
                     f"x{r.get('vs_best_sdpa_graph', nan):.3f} rope +{100 * r['rope_cost_graph']:.1f}%")
        return line
    return (f"rerotate L={r['layers']} pages={r['pages']} | {r['ms']:.3f} ms {r['tbs']:.2f} TB/s | "
            f"torch copy {r['tbs_torch_copy']:.2f} TB/s | x{r['vs_copy']:.2f} of copy | "
            f"naive torch {r['ms_ref']:.3f} ms | err {r['err_k']:.1e} v_equal={r['v_equal']}")


def md_table(intro, header, body, align=None):
    """A paragraph (``None``: none), then a markdown table of ``body`` rows under ``header``
    (a row may be shorter: an error row), then a blank line. ``align``: a separator per
    column (``"---:"`` right-aligns), ``"---"`` for each by default."""
    align = align or ["---"] * len(header)
    lines = [intro, ""] if intro is not None else []
    lines += ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in body] + [""]


def _prefill_tables(pre) -> list[str]:
    """The prefill rows' tables (``pre``: derived rows)."""
    L = []
    L += md_table(
        "`ours` builds the step's cos/sin and runs tables in the call (launch-bound at small shapes); the engine "
        "builds them once per step for all layers, so `table prebuilt` is the per-layer figure.",
        ["prefill q", "kv", "kernel", "ours ms", "ours TFLOP/s", "SDPA ms", "SDPA TFLOP/s", "ours/SDPA",
         "ours ms, table prebuilt", "ours/SDPA, table prebuilt", "rope off ms", "RoPE cost",
         "RoPE cost, table prebuilt", "rel err vs ref"],
        [[r["q"], r["kv"], f"error: {r['error'][:80]}"] if "error" in r else
         [r["q"], r["kv"], r.get("kernel", "triton"), f"{r['ms_rope']:.3f}", f"{r['tflops_rope']:.0f}",
          f"{r['ms_sdpa']:.3f}", f"{r['tflops_sdpa']:.0f}", f"{100 * r['vs_sdpa']:.0f}%",
          f"{r['ms_rope_pretable']:.3f}", f"{100 * r['vs_sdpa_pretable']:.0f}%", f"{r['ms_norope']:.3f}",
          f"{100 * r['rope_cost']:+.1f}%", f"{100 * r['rope_cost_pretable']:+.1f}%", f"{r['err_ref']:.1e}"]
         for r in pre])
    tri = [r for r in pre if r.get("ms_triton_pretable")]
    if tri:
        L += md_table(
            "Where the Gluon prefill served the call (Hopper, `padding_finite=True` as the engine passes), the "
            "Triton prefill (`prefill_kernel=\"triton\"`) on the same shapes, table prebuilt:",
            ["prefill q", "kv", "Triton ms", "Triton rope off ms", "its RoPE cost", "Triton/Gluon time"],
            [[r["q"], r["kv"], f"{r['ms_triton_pretable']:.3f}", f"{r['ms_triton_norope']:.3f}",
              f"{100 * r['triton_rope_cost']:+.1f}%", f"{r['vs_triton']:.2f}x"] for r in tri])
    gr = [r for r in pre if r.get("ms_rope_graph")]
    if gr:
        L += md_table(
            "Prefill replayed from one CUDA graph (tables prebuilt; the GPU time without the launcher's gaps; "
            "each side timed twice, interleaved, and the lower reading kept):",
            ["prefill q", "kv", "kernel", "ours ms", "SDPA ms", "ours/SDPA", "rope off ms", "RoPE cost"],
            [[r["q"], r["kv"], r.get("kernel", "triton"), f"{r['ms_rope_graph_min']:.4f}",
              f"{r.get('ms_sdpa_graph', float('nan')):.4f}", f"{100 * r.get('vs_sdpa_graph', float('nan')):.0f}%",
              f"{r['ms_norope_graph_min']:.4f}", f"{100 * r['rope_cost_graph']:+.1f}%"] for r in gr])
    cu = [r for r in pre if r.get("ms_cudnn")]
    if cu:
        L += md_table(
            "SDPA's cuDNN backend on the same shapes: the causal problem (TFLOP/s on the causal count, as above), "
            "and the same shape without the mask (TFLOP/s on all q x kv pairs: more work than the causal "
            "problem needs):",
            ["prefill q", "kv", "cuDNN causal ms", "TFLOP/s", "rel err vs flash", "cuDNN unmasked ms",
             "TFLOP/s (all pairs)"],
            [[r["q"], r["kv"], f"{r['ms_cudnn']:.3f}", f"{r['tflops_cudnn']:.0f}", f"{r['err_cudnn']:.1e}",
              f"{r['ms_cudnn_nomask']:.3f}", f"{r['tflops_cudnn_nomask']:.0f}"]
             for r in cu])
    sb = [r for r in pre if r.get("best_causal_sdpa")]
    if sb:
        nan = float("nan")
        L += md_table(
            "Against the strongest baseline (ours from CUDA graphs, TFLOP/s on the causal pair count; the "
            "fastest causal SDPA reading of the row, named; cuDNN's unmasked kernel, the FA3-class reference, "
            "by FLOP rate on all pairs, its faster reading of a CUDA graph and do_bench):",
            ["new tokens", "keys", "our kernel", "ours ms", "ours TFLOP/s", "fastest causal SDPA", "its ms",
             "its time / ours", "cuDNN unmasked ms", "its TFLOP/s", "ours / cuDNN unmasked rate", "RoPE cost"],
            [[r["q"], r["kv"], r.get("kernel", "triton").capitalize(), f"{r['ms_rope_graph_min']:.4f}",
              f"{r['tflops_rope_graph']:.0f}", r["best_causal_sdpa"], f"{r['ms_best_causal_sdpa']:.4f}",
              f"{100 * r['vs_best_causal_sdpa']:.0f}%", f"{r.get('ms_cudnn_nomask_best', nan):.4f}",
              f"{r.get('tflops_cudnn_nomask_best', nan):.0f}", f"{100 * r.get('rate_vs_cudnn_nomask', nan):.0f}%",
              f"{100 * r['rope_cost_graph']:+.1f}%"] for r in sb],
            ["---:", "---:", "---"] + ["---:"] * 2 + ["---"] + ["---:"] * 6)
    return L


def _decode_tables(dec) -> list[str]:
    """The decode rows' tables (``dec``: derived rows)."""
    L = []
    L += md_table(
        None,
        ["decode batch", "kv", "ours ms", "ours TB/s", "SDPA ms", "SDPA TB/s", "ours/SDPA", "rope off ms",
         "RoPE cost", "RoPE cost, table prebuilt", "rel err vs ref"],
        [[r["batch"], r["kv"], f"error: {r['error'][:80]}"] if "error" in r else
         [r["batch"], r["kv"], f"{r['ms_rope']:.3f}", f"{r['tbs_rope']:.2f}", f"{r['ms_sdpa']:.3f}",
          f"{r['tbs_sdpa']:.2f}", f"{100 * r['vs_sdpa']:.0f}%", f"{r['ms_norope']:.3f}",
          f"{100 * r['rope_cost']:+.1f}%", f"{100 * r['rope_cost_pretable']:+.1f}%", f"{r['err_ref']:.1e}"]
         for r in dec])
    gr = [r for r in dec if r.get("ms_rope_graph")]
    if gr:
        nan = float("nan")
        L += md_table(
            "Decode replayed from one CUDA graph (as the engine runs it: no launch gaps, L2 not flushed; cos/sin "
            "table prebuilt; ours and cuDNN each timed twice, interleaved, the lower reading kept). SDPA reads "
            "dense, contiguous, already rotated K/V; ours reads pages. `ours/strongest`: the strongest "
            "backend's time over ours (bandwidth ratio, paged against dense):",
            ["decode batch", "kv", "ours ms", "ours TB/s", "strongest SDPA", "its ms", "its TB/s",
             "ours/strongest", "flash ms", "cuDNN ms", "rope off ms", "RoPE cost"],
            [[r["batch"], r["kv"], f"{r['ms_rope_graph_min']:.3f}", f"{r['tbs_rope_graph']:.2f}",
              r.get("best_sdpa", "?"), f"{r.get('ms_best_sdpa_graph', nan):.3f}",
              f"{r.get('tbs_best_sdpa_graph', nan):.2f}", f"{100 * r.get('vs_best_sdpa_graph', nan):.0f}%",
              f"{r.get('ms_sdpa_graph', nan):.3f}", f"{r.get('ms_cudnn_graph_min', nan):.3f}",
              f"{r['ms_norope_graph_min']:.3f}", f"{100 * r['rope_cost_graph']:+.1f}%"] for r in gr])
    return L


def markdown(meta, rows):
    """``kernels.md``: every section's table of ``rows`` under ``meta``'s line."""
    L = [f"Device: {meta['device']}; torch {meta['torch']}, triton {meta['triton']}; {meta['date']}; "
         f"page size {meta['page_size']}; device-to-device copy {meta['copy_tbs']:.2f} TB/s.", ""]
    pre = [derived(r) for r in rows if r["kind"] == "prefill"]
    dec = [derived(r) for r in rows if r["kind"] == "decode"]
    cp = [derived(r) for r in rows if r["kind"] == "rerotate"]
    if pre:
        L += _prefill_tables(pre)
    if dec:
        L += _decode_tables(dec)
    pr = [r for r in rows if r["kind"] == "prefill_runs" and "error" not in r]
    if pr:
        kerns = [k[3:-5] for k in pr[0] if k.startswith("ms_") and k.endswith("_real")]
        L += md_table(
            "Where the prefill's RoPE cost goes (`--prefill-runs`, from CUDA graphs, lowest of three readings): "
            "RoPE on with the real deltas, with every delta 0 (one run), and RoPE off; the RoPE cost split into "
            "the one-run part and the part of the run switches:",
            ["q", "kv", "runs", "kernel", "real ms", "one run ms", "off ms", "RoPE cost", "one run over off",
             "runs over one run", "per run"],
            [[r["q"], r["kv"], r["runs"], k, f"{r[f'ms_{k}_real']:.4f}", f"{r[f'ms_{k}_one_run']:.4f}",
              f"{r[f'ms_{k}_off']:.4f}", f"{100 * (r[f'ms_{k}_real'] / r[f'ms_{k}_off'] - 1):+.1f}%",
              f"{100 * (r[f'ms_{k}_one_run'] / r[f'ms_{k}_off'] - 1):+.1f}%",
              f"{100 * (r[f'ms_{k}_real'] - r[f'ms_{k}_one_run']) / r[f'ms_{k}_off']:+.1f}%",
              f"{1e3 * (r[f'ms_{k}_real'] - r[f'ms_{k}_one_run']) / max(r['runs'] - 1, 1):.2f} us"]
             for r in pr for k in kerns])
    if cp:
        L += md_table(
            None,
            ["re-rotate copy", "ms", "TB/s", "torch copy, same bytes", "of copy bandwidth", "naive torch ms"],
            [[f"{r['layers']} layers x {r['pages']} pages of {r['page_size']} (rows {r['block_rows']}, warps "
              f"{r['num_warps']})", f"{r['ms']:.3f}", f"{r['tbs']:.2f}", f"{r['tbs_torch_copy']:.2f} TB/s",
              f"{100 * r['vs_copy']:.0f}%", f"{r['ms_ref']:.3f}"] for r in cp if "error" not in r])
    return "\n".join(L)
