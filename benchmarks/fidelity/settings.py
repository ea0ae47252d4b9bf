"""``quality.py``'s settings: the reuse mode x chunk context x recovery grid over the
``LazyLLM`` options this tree has, and the quality targets a reusable setting is held to."""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

from benchmarks.fidelity.oracle import ORACLE_SELECTIONS
from lazyllm import LazyLLM
from lazyllm.presets import PRESETS, QUALITY_OPTIONS

THRESHOLDS = {"top1": 0.97, "kl": 0.01, "same_answer": 0.9, "recompute": 0.20, "recompute_long": 0.20,
              "long_chunk_tokens": 256, "needle_rel": 0.98}
SAME_TOKENS = 8  # "same answer": the first this many greedy tokens equal full attention's

# recovery options: LazyLLM keyword -> setting label prefix
RECOVERY_OPTIONS = {"recompute_first_tokens": "first", "recompute_ratio": "ratio"}
_OFF = {"recompute_first_tokens": 0, "recompute_ratio": 0.0}
# how recompute_ratio picks its tokens; "attn-R" settings ask for "attention", the others
# for "deviation" (both explicitly, so a changed default cannot leak into a grid setting)
SELECTION = "recompute_selection"
# LazyLLM keywords that do not change what the model computes (by name, or by these name
# fragments: storage, batching and loading options)
_NEUTRAL_KW = {"self", "model_name_or_path", "model", "tokenizer", "device", "dtype", "kv_cache_bytes",
               "page_size", "attention_backend", "max_batch_tokens", "trust_remote_code", "progress"}
_NEUTRAL_PARTS = ("bytes", "disk", "dir", "path", "cache", "page", "batch", "backend", "thread", "timeout",
                  "progress", "trust", "log")


def _neutral(name: str) -> bool:
    return name in _NEUTRAL_KW or any(part in name for part in _NEUTRAL_PARTS)


# -- settings ------------------------------------------------------------------------
@dataclass
class Setting:
    name: str
    kwargs: dict
    reuse: str
    chunk_context: str
    recovery: str = "none"
    is_default: bool = False
    is_reference: bool = False


def available_options() -> dict:
    """LazyLLM's keyword arguments and their defaults."""
    sig = inspect.signature(LazyLLM.__init__)
    out = {k: (None if p.default is inspect.Parameter.empty else p.default) for k, p in sig.parameters.items()}
    # options a preset may set default to None in the signature: their effective default
    for k, v in QUALITY_OPTIONS.items():
        if k in out and out[k] is None:
            out[k] = v
    return out


def recovery_available(opts: dict | None = None) -> dict:
    opts = available_options() if opts is None else opts
    return {k: k in opts for k in RECOVERY_OPTIONS}


def default_setting(opts: dict) -> Setting:
    """The setting ``LazyLLM()`` runs with when nothing is asked for."""
    quality = {k: v for k, v in opts.items() if not _neutral(k)}
    attn = quality.get(SELECTION) == "attention"
    rec = [f"{'attn' if (k == 'recompute_ratio' and attn) else RECOVERY_OPTIONS.get(k, k)}-{v}"
           for k, v in quality.items()
           if k not in ("reuse", "chunk_context", SELECTION) and v not in (None, 0, 0.0, False)]
    return Setting(name="default", kwargs={}, reuse=quality.get("reuse", "lazy"),
                   chunk_context=quality.get("chunk_context", "isolated"), recovery="+".join(rec) or "none",
                   is_default=True)


def build_settings(modes, contexts, recoveries, opts) -> tuple[list[Setting], list[dict]]:
    """The grid of settings, the configured default and a full-attention self-check; and
    the settings skipped because the engine lacks their option.

    A recovery is ``none``, ``first-K`` (``recompute_first_tokens=K``), ``ratio-R``
    (``recompute_ratio=R``, tokens chosen by key deviation), ``attn-R`` (``recompute_ratio=R``
    with ``recompute_selection="attention"``), ``two-R`` (``"two-stage"``), an oracle
    ``oracle-kv-R`` / ``oracle-attn-R`` / ``oracle-kvattn-R`` / ``oracle-effect-R`` (``install_oracle_selection``:
    measurement only) or a combination joined by ``+`` (``first-4+ratio-0.05``).
    A recovery option that defaults to on is passed as off when unused, so a grid setting
    does not silently inherit a changed default."""
    settings = [Setting("full (self-check)", {"reuse": "none"}, "none", "-", is_reference=True)]
    skipped = []
    for reuse in modes:
        for ctx in contexts:
            for rec in recoveries:
                kw = {"reuse": reuse, "chunk_context": ctx}
                # an option that does not default to off is switched off explicitly
                kw.update({opt: _OFF[opt] for opt in RECOVERY_OPTIONS if opts.get(opt, 0) not in (0, None)})
                missing = []
                for part in ([] if rec == "none" else rec.split("+")):
                    kind, val = part.rsplit("-", 1)
                    opt = "recompute_first_tokens" if kind == "first" else "recompute_ratio"
                    if kind not in ("first", "ratio", "attn", "two", *ORACLE_SELECTIONS):
                        raise SystemExit(f"unknown recovery {part!r}")
                    if opt not in opts:
                        missing.append(opt)
                    kw[opt] = int(val) if kind == "first" else float(val)
                    if kind != "first":
                        if SELECTION not in opts:
                            if kind != "ratio":
                                missing.append(SELECTION)
                        else:
                            kw[SELECTION] = {"attn": "attention", "two": "two-stage"}.get(
                                kind, kind if kind in ORACLE_SELECTIONS else "deviation")
                if missing:
                    skipped.append({"setting": f"{reuse}/{ctx}/{rec}",
                                    "reason": "LazyLLM has no " + ", ".join(f"`{m}`" for m in missing)
                                              + " option yet"})
                    continue
                settings.append(Setting(f"{reuse}/{ctx}/{rec}", kw, reuse, ctx, rec))
    d = default_setting(opts)
    # the default is one of the grid settings when it sets nothing beyond reuse, chunk
    # context and the known recovery options, with the same values
    quality = {k: v for k, v in opts.items() if not _neutral(k)}
    unknown = {k: v for k, v in quality.items() if k not in ("reuse", "chunk_context", SELECTION, *RECOVERY_OPTIONS)
               and v not in (None, 0, 0.0, False)}
    for s in settings:
        if s.is_reference or unknown:
            continue
        same = s.reuse == d.reuse and s.chunk_context == d.chunk_context and all(
            (s.kwargs.get(k) or 0) == (quality.get(k) or 0) for k in RECOVERY_OPTIONS if k in quality) and (
            not quality.get("recompute_ratio")
            or s.kwargs.get(SELECTION, "deviation") == quality.get(SELECTION, "deviation"))
        if same:
            s.is_default = True
            return settings, skipped
    d.name = f"default ({d.reuse}/{d.chunk_context}/{d.recovery})"
    settings.append(d)
    return settings, skipped


def grid_settings(args, opts: dict, log) -> tuple[list[Setting], list[dict]]:
    """``quality.py``'s settings from its arguments: the grid, the presets, the JSON settings;
    and the skipped ones. Logs each option this tree defaults to a value the grid leaves as is."""
    settings, skipped = build_settings([m for m in args.modes.split(",") if m], args.contexts.split(","),
                                       [r for r in args.recoveries.split(",") if r], opts)
    settings = [st for st in settings if not ((args.no_self_check and st.is_reference)
                                              or (args.no_default and st.is_default and not st.kwargs))]
    for name in filter(None, args.presets.split(",")):
        p = PRESETS[name]
        rec = "+".join(([f"first-{p['recompute_first_tokens']}"] if p.get("recompute_first_tokens") else [])
                       + ([f"{p.get('recompute_selection', 'deviation')}-{p['recompute_ratio']}"]
                          if p.get("recompute_ratio") else [])) or "none"
        settings.append(Setting(f"preset {name} ({p['reuse']}/{p['chunk_context']}/{rec})", {"quality": name},
                                p["reuse"], p["chunk_context"], rec))
    for name, kw in (json.loads(args.settings_json).items() if args.settings_json else ()):
        settings.append(Setting(name, kw, kw.get("reuse", "lazy"), kw.get("chunk_context", "isolated"), "custom"))
    for k, v in opts.items():
        if not _neutral(k) and k not in ("reuse", "chunk_context", SELECTION, *RECOVERY_OPTIONS) \
                and v not in (None, 0, 0.0, False):
            log(f"note: LazyLLM option `{k}` defaults to {v!r}; this benchmark does not vary it, so every "
                f"chunked setting runs with it")
    return settings, skipped


def check_thresholds(res: dict, ref_needle: float | None, chunk_tokens: int) -> dict:
    t = THRESHOLDS
    rmax = t["recompute_long"] if chunk_tokens >= t["long_chunk_tokens"] else t["recompute"]
    needle_rel = None
    if res["needle_acc"] is not None and ref_needle:
        needle_rel = res["needle_acc"] / ref_needle
    checks = {"top1": res["top1"] >= t["top1"], "kl": res["kl"] <= t["kl"],
              "same_answer": res["same_answer"] >= t["same_answer"],
              "recompute": res["recompute_frac"] <= rmax,
              "needle": needle_rel is None or needle_rel >= t["needle_rel"]}
    return dict(needle_rel=needle_rel, recompute_max=rmax, checks=checks, meets=all(checks.values()))


# -- report --------------------------------------------------------------------------
def _pct(x, d=1):
    return "-" if x is None else f"{100 * x:.{d}f}%"


def markdown_table(out: dict) -> str:
    n_ans = out["config"]["answer_tokens"]
    lines = [
        f"| setting | top-1 agree | KL nats/tok | same answer ({SAME_TOKENS} tok) | greedy match "
        "| needle acc (vs full) "
        "| recomputed chunk tokens | prefill tok/query | TTFT ms (median) | meets targets |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    ref = out["reference"]
    lines.append(f"| full attention (reference, cold) | 100.0% | 0 | 100% | 100% | {_pct(ref['needle_acc'], 0)} | - | "
                 f"{ref['prefill_per_prompt']:.0f} | {ref['ttft_ms']:.0f} | - |")
    for r in out["results"]:
        name = r["setting"] + (" **(default)**" if r["is_default"] and not r["setting"].startswith("default")
                               else "")
        needle = "-" if r["needle_acc"] is None else (
            f"{_pct(r['needle_acc'], 0)} ({_pct(r['needle_rel'], 0)})" if r["needle_rel"] is not None
            else _pct(r["needle_acc"], 0))
        meets = "-" if r["is_reference"] else ("yes" if r["meets"] else
                                               "no (" + ", ".join(k for k, v in r["checks"].items() if not v) + ")")
        lines.append(f"| {name} | {_pct(r['top1'])} | {r['kl']:.4f} | {_pct(r['same_answer'], 0)} | "
                     f"{_pct(r['greedy_match'], 0)} | {needle} | "
                     f"{_pct(r['recompute_frac'])} | {r['prefill_per_prompt']:.0f} | {r['ttft_ms']:.0f} | {meets} |")
    return "\n".join(lines) + f"\n\n(greedy match: first {n_ans} answer tokens, {out['config']['needle_tokens']} " \
                              f"on needle prompts)"
