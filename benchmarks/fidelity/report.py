"""The fidelity report on a split of the real-prose suite, run in slices that are saved as
they finish (a long CPU run can stop and resume), then one table: each setting beside the
order floor, its ratios to it, and the setting the default rule picks.

    python benchmarks/quality.py prose --split test --out /tmp/fid            # measure, then print
    python benchmarks/quality.py prose --out /tmp/fid --table-only            # print what is saved
    python benchmarks/quality.py prose --model gemma3-270m --settings default,balanced
    python benchmarks/quality.py prose --out /tmp/fid --table-only --curve fast   # adaptive recompute

``--jobs N`` measures the slices in N processes at once (each with its share of the cores);
the table and the time are the same either way.

The rule (``FidelityReport.floor_choice``): the cheapest setting whose same-answer rate is at
least the floor's and whose KL is at most twice the floor's. Top-1 and KL are means over
answer tokens, same answer over cases (over (case, order) pairs for the floor), as in
``python -m lazyllm.quality``.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

from benchmarks._common import HERE

QUALITY = os.path.join(HERE, "quality.py")  # the command: quality.py prose

# each setting named by its preset, so a row means the same whatever LazyLLM()'s default is
SETTINGS = {"default": {}, "isolated+packet": {"quality": "isolated"},
            "isolated": {"quality": "isolated", "packets": None},
            "fast": {"quality": "fast"}, "balanced": {"quality": "balanced"},
            # balanced's recompute without its adaptive escalation: the base of its curve
            "recompute-only": {"quality": "balanced", "escalate_below": 0.0}}


def aggregate(reports: list[dict]) -> tuple[list[dict], dict]:
    """Rows and floor over the saved slices, weighted as one report over all their cases."""
    acc: dict[str, dict] = {}
    fl = dict(kl=0.0, top1=0.0, same=0, pairs=0, tok=0, kl_mean=0.0, orders=None)
    for rep in reports:
        for r in rep["rows"]:
            a = acc.setdefault(r["setting"], dict(setting=r["setting"], tok=0, kl=0.0, top1=0.0, same=0, cases=0,
                                                  rec=0.0, chunk=0, kl_mean=0.0, km_tok=0))
            a["tok"] += r["tokens"]
            a["kl"] += r["kl"] * r["tokens"]
            a["top1"] += r["top1"] * r["tokens"]
            a["same"] += r["same_answer_n"]
            a["cases"] += r["cases"]
            if r.get("kl_mean") is not None:
                a["kl_mean"] += r["kl_mean"] * r["tokens"]
                a["km_tok"] += r["tokens"]
        for pc in rep["cases"]:
            a = acc[pc["setting"]]
            a["rec"] += pc["recomputed"]
            a["chunk"] += pc["chunk_tokens"]
        f = rep.get("floor") or {}
        if f.get("pairs"):
            fl["orders"] = f["orders"]
            fl["pairs"] += f["pairs"]
            fl["same"] += f["same_answer_n"]
            fl["tok"] += f["tokens"]
            fl["kl"] += f["kl"] * f["tokens"]
            fl["top1"] += f["top1"] * f["tokens"]
            fl["kl_mean"] += f["kl_mean"] * f["tokens"]
    rows = [dict(setting=a["setting"], cases=a["cases"], tokens=a["tok"], kl=a["kl"] / a["tok"],
                 top1=a["top1"] / a["tok"], same_answer=a["same"] / a["cases"], same_answer_n=a["same"],
                 kl_mean=a["kl_mean"] / a["km_tok"] if a["km_tok"] else None,
                 recomputed=a["rec"] / a["chunk"] if a["chunk"] else 0.0, ttft_ms=None) for a in acc.values()]
    floor = dict(setting="order floor", orders=fl["orders"], pairs=fl["pairs"], same_answer_n=fl["same"],
                 same_answer=fl["same"] / fl["pairs"] if fl["pairs"] else None,
                 kl=fl["kl"] / fl["tok"] if fl["tok"] else None, top1=fl["top1"] / fl["tok"] if fl["tok"] else None,
                 kl_mean=fl["kl_mean"] / fl["tok"] if fl["tok"] else None)
    return rows, floor


def table(rows: list[dict], floor: dict) -> str:
    """Markdown: the floor, then each setting's metrics with its ratio to the floor."""
    from lazyllm.quality import FidelityReport
    from lazyllm.quality.floor import ratios, within_floor

    lines = ["| setting | top-1 agreement | mean KL | same first 8 tokens | KL to order-mean | recomputed | "
             "inside the floor |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
             f"| order floor ({floor['orders']} other orders) | {100 * floor['top1']:.1f}% | {floor['kl']:.3f} | "
             f"{100 * floor['same_answer']:.1f}% ({floor['same_answer_n']}/{floor['pairs']}) | "
             f"{floor['kl_mean']:.3f} | 100% | - |"]
    for r in rows:
        q = ratios(r, floor)
        km = "-" if r["kl_mean"] is None else f"{r['kl_mean']:.3f}"
        lines.append(f"| {r['setting']} | {100 * r['top1']:.1f}% ({q['top1']:.2f}x) | {r['kl']:.3f} "
                     f"({q['kl']:.2f}x) | {100 * r['same_answer']:.1f}% ({r['same_answer_n']}/{r['cases']}; "
                     f"{q['same_answer']:.2f}x) | {km} | {100 * r['recomputed']:.1f}% | "
                     f"{'yes' if within_floor(r, floor) else 'no'} |")
    rep = FidelityReport(rows=rows, target={}, floor=floor)
    return "\n".join(lines) + f"\n\nThe rule's choice: **{rep.floor_choice()}**."


def by_kind(reports: list[dict], kinds: dict[str, str]) -> str:
    """Markdown: same first 8 tokens per kind of question, per setting and for the floor."""
    same: dict[tuple[str, str], list[int]] = {}
    for rep in reports:
        for pc in rep["cases"]:
            k = kinds.get(pc["id"], "?")
            if pc["setting"] == "full attention" and pc.get("floor"):
                f = same.setdefault(("order floor", k), [0, 0])
                f[0] += pc["floor"]["same"]
                f[1] += pc["floor"]["orders"]
            else:
                s = same.setdefault((pc["setting"], k), [0, 0])
                s[0] += bool(pc["same_answer"])
                s[1] += 1
    names = list(dict.fromkeys(n for n, _ in same if n != "full attention"))
    ks = sorted({k for _, k in same})
    lines = ["| same first 8 tokens | " + " | ".join(ks) + " |", "| --- |" + " ---: |" * len(ks)]
    for n in names:
        cells = [f"{100 * a / b:.0f}% ({a}/{b})" if b else "-" for a, b in (same.get((n, k), [0, 0]) for k in ks)]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="quality.py prose", description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", default="test", help="train, dev or test (benchmarks/data/prose/<split>.jsonl)")
    ap.add_argument("--cases", default=None, help="another JSONL instead of --split")
    ap.add_argument("--out", required=True, help="folder for the slices' JSON reports")
    ap.add_argument("--model", default=None, help="model (default: the embedded default model)")
    ap.add_argument("--settings", default="isolated+packet,isolated,fast,balanced",
                    help=f"comma separated, of {sorted(SETTINGS)}")
    ap.add_argument("--orders", type=int, default=4, help="other orders of each case's documents (the floor)")
    ap.add_argument("--slice", type=int, default=20, help="cases a saved slice")
    ap.add_argument("--answer-tokens", type=int, default=8,
                    help="full attention's answer length every setting is teacher-forced on (top-1 and KL are "
                         "over these; same answer over the first 8)")
    ap.add_argument("--limit", type=int, default=None, help="the first N cases only")
    ap.add_argument("--first-slice", type=int, default=0, help="start at this slice (another process runs the earlier)")
    ap.add_argument("--jobs", type=int, default=1, help="processes measuring slices at once")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--table-only", action="store_true", help="print the table of what is saved")
    ap.add_argument("--curve", default=None, metavar="SETTING",
                    help="also print the adaptive-recompute curve over this setting (lazyllm.quality.adaptive)")
    ap.add_argument("--escalate-tokens", type=int, default=1, metavar="N",
                    help="the curve's window: the first N answer tokens' margins (escalate_tokens)")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error("--jobs must be at least 1")
    os.makedirs(a.out, exist_ok=True)
    if a.worker is not None:
        _measure(a)
        return
    if not a.table_only:
        t0 = time.perf_counter()
        if a.jobs == 1:
            _measure(a)
        else:
            _run_workers(argv if argv is not None else sys.argv[1:], a.jobs, a.out)
        print(f"measured in {time.perf_counter() - t0:.0f} s of wall time ({a.jobs} process(es))", flush=True)
    reports = []
    for p in sorted(glob.glob(os.path.join(a.out, "slice-*.json"))):
        with open(p, encoding="utf-8") as f:
            reports.append(json.load(f))
    rows, floor = aggregate(reports)
    print(table(rows, floor))
    with open(_path(a), encoding="utf-8") as f:
        kinds = {str(c.get("id")): c.get("kind", "?") for c in map(json.loads, filter(None, f.read().splitlines()))}
    print("\n" + by_kind(reports, kinds))
    print(f"\n{sum(r['n_cases'] for r in reports)} cases in {len(reports)} slices; measured "
          f"{sum(r.get('wall_s', 0) for r in reports):.0f} s in all (summed over the slices)")
    if a.curve:
        from lazyllm.config import EngineConfig
        from lazyllm.quality.adaptive import curve_markdown, escalation_curve

        cfg = EngineConfig.resolve(**SETTINGS.get(a.curve, {}))
        if cfg.packets is not None and cfg.chunk_context == "isolated":
            ap.error(f"--curve {a.curve}: the engine escalates only without packets (full attention has no "
                     "packet tokens), so a packet setting's curve would not be what it runs")
        cases = [pc for rep in reports for pc in rep["cases"]]
        print(f"\nAdaptive recompute over {a.curve}: requests whose top-2 margin over their first "
              f"{a.escalate_tokens} answer token(s) is lowest answered by full attention\n")
        print(curve_markdown(escalation_curve(cases, a.curve, floor, window=a.escalate_tokens)))


def _run_workers(argv: list[str], jobs: int, out: str) -> None:
    """The same command in ``jobs`` processes, each taking the next slice nobody has claimed
    (``_claim``), each with ``cpu_count // jobs`` threads."""
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    for p in glob.glob(os.path.join(out, "slice-*.json.claim")):
        os.remove(p)  # a stopped run's claims: its unsaved slices are measured again
    procs = [subprocess.Popen([sys.executable, QUALITY, "prose", *argv, "--worker", str(w)], env=env)
             for w in range(jobs)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a worker failed (exit codes {codes})")


def _claim(out: str, worker: int | None) -> bool:
    """Whether this process measures the slice saved as ``out``: the first worker to create
    its claim file takes it (slices take unequal times, so the workers share them as they
    free up); a lone process takes every slice not saved yet."""
    if worker is None:
        return True
    try:
        os.close(os.open(out + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _path(a) -> str:
    return a.cases or os.path.join(HERE, "data", "prose", f"{a.split}.jsonl")


def _measure(a) -> None:
    from lazyllm import LazyLLM
    from lazyllm.quality import compare, load_cases

    cases = load_cases(_path(a))[: a.limit]
    names = [n for n in a.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown setting(s) {unknown}; choose from {sorted(SETTINGS)}")
    settings = [(n, SETTINGS[n]) for n in names]
    llm = LazyLLM(a.model, reuse="none", kv_cache_bytes=256 << 20, progress=False)
    try:
        for i in range(a.first_slice * a.slice, len(cases), a.slice):
            out = os.path.join(a.out, f"slice-{i // a.slice:03d}.json")
            if os.path.exists(out) or not _claim(out, a.worker):
                continue
            t0 = time.perf_counter()
            rep = compare(llm, cases[i:i + a.slice], settings, progress=False, ttft_cases=0, orders=a.orders,
                          answer_tokens=a.answer_tokens)
            d = rep.to_dict()
            d["wall_s"] = time.perf_counter() - t0
            with open(out + ".part", "w", encoding="utf-8") as f:
                json.dump(d, f, default=str)
            os.replace(out + ".part", out)
            print(f"slice {i // a.slice}: {rep.n_cases} cases in {d['wall_s']:.0f} s", flush=True)
    finally:
        llm.close()

