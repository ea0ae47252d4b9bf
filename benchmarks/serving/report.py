"""``rag_serving.py``'s figures: a point's row (percentiles, the finish rate, where the engine's
time went), which Poisson points were sustained, the acceptance summary, the table and the
plots."""
from __future__ import annotations

import math
import os
import statistics


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(math.ceil(q * len(xs))) - 1)] if xs else float("nan")


def finish_rate(done: list[float], fallback: float) -> float:
    """Completions per second: 1 / the least-squares slope of the sorted completion times
    against their rank (all completions weigh in, not just the first and the last, whose
    latencies would add their noise to a short run)."""
    n = len(done)
    if n < 2:
        return fallback
    mi, mt = (n - 1) / 2, sum(done) / n
    cov = sum((i - mi) * (t - mt) for i, t in enumerate(done))
    var = sum((i - mi) ** 2 for i in range(n))
    return var / cov if cov > 0 else fallback


def engine_profile(m0: dict, m: dict, wall: float) -> dict:
    """Where a point's time went, from the engine's counters before (``m0``) and after
    (``m``): the engine thread's seconds in prefill and in decode steps as shares of the
    wall time, decode steps and their mean batch, the share of steps served by shared-chunk
    decode, and how many shared plans were built (a plan is rebuilt when the rows change)."""
    d = {k: m.get(k, 0) - m0.get(k, 0) for k in ("prefill_s", "decode_s", "decode_steps", "decode_tokens",
                                                 "shared_decode_steps", "shared_plans", "prefill_tokens")}
    steps = max(d["decode_steps"], 1)
    return dict(prefill_share=d["prefill_s"] / wall, decode_share=d["decode_s"] / wall,
                decode_steps=d["decode_steps"], mean_batch=d["decode_tokens"] / steps,
                ms_per_step=1e3 * d["decode_s"] / steps, shared_step_share=d["shared_decode_steps"] / steps,
                shared_plans=d["shared_plans"],
                prefill_ms_per_1k_tokens=1e6 * d["prefill_s"] / max(d["prefill_tokens"], 1))


def summarize_point(system, budget, rate, alpha, res, wall, extra) -> dict:
    failed = [x for x, _ in res if "error" in x]
    ok = [(x, t) for x, t in res if "error" not in x]
    row = dict(system=system, budget=budget, rate=rate, alpha=alpha, requests=len(ok), failed=len(failed),
               wall_s=wall, **extra)
    if failed:
        row["error"] = failed[0]["error"]
    if not ok:
        row.update(ttft_p50_ms=float("nan"), ttft_p95_ms=float("nan"), tpot_ms=float("nan"), req_per_s=0.0,
                   out_tok_per_s=0.0, finish_rate=0.0, hit_rate=0.0, prompt_hit_rate=0.0,
                   chunk_tokens=0, cached_chunk_tokens=0)
        return row
    xs = [x for x, _ in ok]
    ttft = [x["ttft"] for x in xs]
    done = sorted(t for _, t in ok)
    chunk, cached_chunk = sum(x["chunk"] for x in xs), sum(x["cached_chunk"] for x in xs)
    row.update(ttft_p50_ms=statistics.median(ttft) * 1e3, ttft_p95_ms=pct(ttft, 0.95) * 1e3,
               tpot_ms=statistics.median(x["tpot"] for x in xs) * 1e3, req_per_s=len(xs) / wall,
               out_tok_per_s=sum(x["out"] for x in xs) / wall,
               # Poisson only: a closed loop's clients finish in waves, its rate is req/s
               finish_rate=finish_rate(done, len(xs) / wall) if rate > 0 else len(xs) / wall,
               hit_rate=cached_chunk / max(chunk, 1), chunk_tokens=chunk, cached_chunk_tokens=cached_chunk,
               prompt_hit_rate=sum(x["cached"] for x in xs) / max(sum(x["prompt"] for x in xs), 1))
    return row


def mark_sustained(rows, factor: float) -> None:
    """Set ``sustained`` on every Poisson row (None on closed-loop rows); see the module
    docstring for the definition."""
    groups: dict = {}
    for r in rows:
        if r["rate"] > 0:
            groups.setdefault((r["system"], r["alpha"], r["budget"]), []).append(r)
    for r in rows:
        r["sustained"] = None
    for grp in groups.values():
        grp.sort(key=lambda r: r["rate"])
        base = grp[0]["ttft_p95_ms"]
        for r in grp:
            r["sustained"] = bool(r["failed"] == 0 and r["requests"] > 0 and r["finish_rate"] >= 0.9 * r["rate"]
                                  and r["ttft_p95_ms"] <= factor * base)


def _ratio(a, b):
    return a / b if b and not math.isnan(b) and not math.isnan(a) else float("nan")


def summarize(rows) -> list[dict]:
    """Per (alpha, budget) with lazy and block rows: the acceptance figures (see the module
    docstring); per alpha with hf rows: lazy against hf."""
    out = []
    keys = sorted({(r["alpha"], r["budget"]) for r in rows if r["system"] in ("lazy", "block")}, reverse=True)
    for alpha, budget in keys:
        sel = {s: [r for r in rows if r["system"] == s and r["alpha"] == alpha and r["budget"] == budget]
               for s in ("lazy", "block")}
        if not sel["lazy"] or not sel["block"]:
            continue
        s = dict(alpha=alpha, budget=budget)

        def best(system):  # the highest rate below which every swept rate is sustained
            out = None
            for r in sorted((r for r in sel[system] if r["rate"] > 0), key=lambda r: r["rate"]):
                if not r["sustained"]:
                    break
                out = r
            return out

        lb, bb = best("lazy"), best("block")
        s["lazy_max_sustained_rate"] = lb["rate"] if lb else None
        s["block_max_sustained_rate"] = bb["rate"] if bb else None
        if bb:
            lz = next((r for r in sel["lazy"] if r["rate"] == bb["rate"]), None)
            if lz:
                s["at_block_max"] = dict(rate=bb["rate"], lazy_ttft_p50_ms=lz["ttft_p50_ms"],
                                         block_ttft_p50_ms=bb["ttft_p50_ms"],
                                         ttft_p50_ratio=_ratio(bb["ttft_p50_ms"], lz["ttft_p50_ms"]),
                                         ttft_p95_ratio=_ratio(bb["ttft_p95_ms"], lz["ttft_p95_ms"]),
                                         req_per_s_ratio=_ratio(lz["req_per_s"], bb["req_per_s"]),
                                         hit_rate_ratio=_ratio(lz["hit_rate"], bb["hit_rate"]))
        if lb and bb:
            s["sustained_throughput_ratio"] = _ratio(lb["finish_rate"], bb["finish_rate"])
            s["sustained_rate_ratio"] = _ratio(lb["rate"], bb["rate"])
        cl = {k: next((r for r in v if r["rate"] == 0), None) for k, v in sel.items()}
        if cl["lazy"] and cl["block"]:
            s["closed_loop"] = dict(lazy_req_per_s=cl["lazy"]["req_per_s"], block_req_per_s=cl["block"]["req_per_s"],
                                    throughput_ratio=_ratio(cl["lazy"]["req_per_s"], cl["block"]["req_per_s"]),
                                    ttft_p50_ratio=_ratio(cl["block"]["ttft_p50_ms"], cl["lazy"]["ttft_p50_ms"]))
        pooled = {k: sum(r["cached_chunk_tokens"] for r in v) / max(sum(r["chunk_tokens"] for r in v), 1)
                  for k, v in sel.items()}
        s["lazy_hit_rate"], s["block_hit_rate"] = pooled["lazy"], pooled["block"]
        s["hit_rate_ratio"] = _ratio(pooled["lazy"], pooled["block"])
        out.append(s)
    for alpha in sorted({r["alpha"] for r in rows if r["system"] == "hf"}, reverse=True):
        for h in [r for r in rows if r["system"] == "hf" and r["alpha"] == alpha]:
            lz = [r for r in rows if r["system"] == "lazy" and r["alpha"] == alpha and r["rate"] == h["rate"]]
            if not lz:
                continue
            lz = max(lz, key=lambda r: r["budget"])
            out.append(dict(alpha=alpha, rate=h["rate"], vs="hf", lazy_budget=lz["budget"],
                            throughput_ratio=_ratio(lz["req_per_s"], h["req_per_s"]),
                            ttft_p50_ratio=_ratio(h["ttft_p50_ms"], lz["ttft_p50_ms"])))
    return out


def fmt(x, spec=".2f"):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_summary(summary) -> None:
    print("\nSummary (ratios are lazy's advantage: >1 favours lazy)")
    for s in summary:
        if s.get("vs") == "hf":
            print(f"- alpha {s['alpha']}, rate {s['rate'] or 'closed loop'}: lazy (budget {s['lazy_budget']}) vs hf: "
                  f"throughput {fmt(s['throughput_ratio'])}x, TTFT p50 {fmt(s['ttft_p50_ratio'])}x lower")
            continue
        line = (f"- alpha {s['alpha']}, budget {s['budget']}: block sustains up to "
                f"{fmt(s['block_max_sustained_rate'], 'g')} req/s, lazy up to "
                f"{fmt(s['lazy_max_sustained_rate'], 'g')} req/s")
        if "at_block_max" in s:
            a = s["at_block_max"]
            line += (f"; at {a['rate']:g} req/s: TTFT p50 {fmt(a['ttft_p50_ratio'])}x lower "
                     f"({a['lazy_ttft_p50_ms']:.0f} vs {a['block_ttft_p50_ms']:.0f} ms), "
                     f"req/s {fmt(a['req_per_s_ratio'])}x")
        if "sustained_throughput_ratio" in s:
            line += f"; sustained throughput {fmt(s['sustained_throughput_ratio'])}x"
        if "closed_loop" in s:
            c = s["closed_loop"]
            line += (f"; closed loop: throughput {fmt(c['throughput_ratio'])}x ({c['lazy_req_per_s']:.2f} vs "
                     f"{c['block_req_per_s']:.2f} req/s), TTFT p50 {fmt(c['ttft_p50_ratio'])}x lower")
        line += (f"; chunk hit rate {fmt(s['lazy_hit_rate'])} vs {fmt(s['block_hit_rate'])} "
                 f"({fmt(s['hit_rate_ratio'])}x)")
        print(line)


def _ttft_vs_rate(plt, rows, systems, colors, out_dir) -> None:
    """TTFT p50 against the offered rate, one panel per (alpha, budget); hollow markers: not
    sustained."""
    configs = sorted({(r["alpha"], r["budget"]) for r in rows if r["rate"] > 0 and r["system"] != "hf"},
                     key=lambda c: (-c[0], c[1]))
    n = max(1, len(configs))
    fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.6), squeeze=False)
    for ax, (alpha, budget) in zip(axes[0], configs):
        for s in systems:
            pts = sorted((r["rate"], r["ttft_p50_ms"], r["sustained"]) for r in rows if r["system"] == s
                         and r["rate"] > 0 and r["alpha"] == alpha and (r["budget"] == budget or s == "hf"))
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[s], label=s)
            for x, y, ok in pts:
                ax.plot([x], [y], marker="o", color=colors[s], markerfacecolor=colors[s] if ok else "none")
        ax.set_yscale("log")
        ax.set_title(f"alpha {alpha:g}, KV budget {budget:g}", fontsize=9)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("TTFT p50 (ms)")
        ax.legend(fontsize=8)
    if not configs:
        axes[0][0].text(0.5, 0.5, "no Poisson rates in this run", ha="center")
    fig.suptitle("TTFT p50 vs rate (hollow: rate not sustained)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "ttft_vs_rate.png"), dpi=120)
    plt.close(fig)


def plot(rows, out_dir):
    """``ttft_vs_rate.png``, ``throughput_vs_budget.png`` and ``hit_rate_vs_budget.png`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    systems = sorted({r["system"] for r in rows})
    colors = {s: f"C{i}" for i, s in enumerate(systems)}
    _ttft_vs_rate(plt, rows, systems, colors, out_dir)

    def by_budget(y, name, ylabel, title):
        fig, ax = plt.subplots(figsize=(5.2, 3.6))
        for s in systems:
            if s == "hf":
                continue
            for j, alpha in enumerate(sorted({r["alpha"] for r in rows}, reverse=True)):
                pts = []
                for b in sorted({r["budget"] for r in rows if r["system"] == s and r["alpha"] == alpha}):
                    grp = [r for r in rows if r["system"] == s and r["alpha"] == alpha and r["budget"] == b]
                    pts.append((b, y(grp)))
                pts = [p for p in pts if p[1] is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^v"[j % 4], color=colors[s],
                            linestyle="-" if j == 0 else "--", label=f"{s}, alpha {alpha:g}")
        ax.set_xlabel("KV budget (fraction of the document pool)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=120)
        plt.close(fig)

    def throughput(grp):
        closed = [r for r in grp if r["rate"] == 0]
        if closed:
            return closed[0]["req_per_s"]
        ok = [r for r in grp if r["sustained"]]
        return max(r["finish_rate"] for r in ok) if ok else None

    def hit(grp):
        return sum(r["cached_chunk_tokens"] for r in grp) / max(sum(r["chunk_tokens"] for r in grp), 1)

    by_budget(throughput, "throughput_vs_budget.png", "req/s",
              "throughput vs KV budget (closed loop, else best sustained)")
    by_budget(hit, "hit_rate_vs_budget.png", "chunk hit rate", "chunk hit rate vs KV budget")


def print_table(rows) -> None:
    print("| system | alpha | rate | KV budget | done/failed | TTFT p50 ms | TTFT p95 ms | TPOT ms | req/s | finish/s "
          "| sustained | out tok/s | chunk hit rate | prompt hit rate | prefilled tokens | peak KV GiB | copied GiB "
          "| evictions | preemptions |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: | ---: | ---: |")
    for r in rows:
        sus = {None: "—", True: "yes", False: "no"}[r["sustained"]]
        print(f"| {r['system']} | {r['alpha']:g} | {r['rate'] or 'closed'} | {r['budget']:.2f} | "
              f"{r['requests']}/{r['failed']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p95_ms']:.1f} | {r['tpot_ms']:.1f} | "
              f"{r['req_per_s']:.2f} | {r['finish_rate']:.2f} | {sus} | {r['out_tok_per_s']:.1f} | "
              f"{r['hit_rate']:.2f} | {r['prompt_hit_rate']:.2f} | {r['prefill_tokens']} | {fmt(r['peak_kv_gib'])} | "
              f"{fmt(r['copied_gib'])} | {r['evictions']} | {r['preemptions']} |")
