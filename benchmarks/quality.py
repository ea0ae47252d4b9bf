"""Fidelity of chunked attention (lazy / block reuse, with and without recovery) against
full attention, on RAG prompts over text that ships offline.

Documents are docstrings of the Python standard library (``inspect.getdoc``), each cut to
about ``--chunk-tokens`` tokens at a sentence boundary. Questions are of three kinds:
``what`` ("What does `json.dumps` do?"), ``cloze`` (a sentence of one document with a word
blanked out) and ``needle`` (a planted fact such as "The access code for vault 17 is 4821."
inserted into one of the documents; the answer is the exact number). Every question is asked
with ``--orders`` different orders of its documents, each one a separate prompt.

For each prompt, full attention (``reuse="none"``) gives the reference: its greedy answer
(``generate`` at temperature 0) and its teacher-forced logits on that answer (``score``).
Each setting (reuse mode x chunk context x recovery) then scores the same answer tokens on
the same prompt, with its chunks warmed beforehand in another order (so cached KV is reused
at other positions), and generates its own greedy answer to the needle prompts. Reported
per setting:

- top-1 agreement: fraction of answer positions where the setting's argmax equals full
  attention's argmax;
- KL: mean over answer tokens of KL(full || setting), nats per token;
- greedy match: fraction of prompts whose greedy answer equals full attention's token for
  token (the first ``--answer-tokens`` tokens; ``--needle-tokens`` for needle prompts). The
  setting's greedy answer equals the reference iff its teacher-forced argmax is the
  reference token at every answer position (both see the same context up to the first
  difference), so this is read off the scores; on the needle prompts, where the setting
  also generates, the JSON counts any disagreement between the two (``greedy_check_*``);
- needle accuracy: fraction of needle prompts whose greedy answer contains the planted
  answer, and its ratio to full attention's needle accuracy;
- recompute: extra prefill tokens beyond the question and answer (chunk tokens recomputed
  by recovery), as a fraction of the prompt's chunk tokens;
- TTFT: median over ``--ttft-prompts`` solo requests (one new token): cold for full
  attention (it caches nothing), warm chunk cache for the chunked settings.

Greedy answers are generated with ``generate_batch``, and ``--score-workers`` score requests
are in flight at once so that the engine batches them (the full-attention self-check row
would show it if batching changed the numbers); the TTFT requests run one at a time.

    python benchmarks/quality.py                      # full run, default model, CPU
    python benchmarks/quality.py --quick              # a small slice (CI)
    python benchmarks/quality.py --model PATH --chunk-tokens 256 --json out.json
    python benchmarks/quality.py --modes "" --presets fast,balanced,exact   # the LazyLLM(quality=...) presets
    python benchmarks/quality.py --cases tests/data/quality_heldout.jsonl   # the fidelity report on a JSONL

``--cases`` runs ``lazyllm.quality.compare`` (the fidelity report users run on their own data,
whose metric code this benchmark shares) on the given cases instead of the built-in corpus.

Oracle recompute selections (an upper bound for selective recompute, not engine options):
recoveries ``oracle-kv-R``, ``oracle-attn-R``, ``oracle-kvattn-R``, ``oracle-effect-R``, or
``"recompute_selection": "oracle-kv"`` (etc.) in ``--settings-json``, choose the tokens with
full attention's KV and attention over the same prompt (see ``ORACLE_SELECTIONS``); each
oracle setting also reports which tokens it picked (``oracle_picks``).

    python benchmarks/quality.py --modes lazy --contexts prefix --recoveries oracle-kv-0.2,first-4+oracle-kvattn-0.15

Options the engine does not have yet (``recompute_first_tokens``, ``recompute_ratio``) are
detected with ``inspect.signature(LazyLLM.__init__)``; their settings are skipped with a
note. A model that lazyllm does not support is reported as such (exit status 2).

Subcommands (``quality.py NAME --help``; their code and this script's parts: ``benchmarks/fidelity/``):

    python benchmarks/quality.py prose --split test --out DIR --slice 10 --jobs 2   # real prose
    python benchmarks/quality.py prose-suite [--check]    # (re)build benchmarks/data/prose/
    python benchmarks/quality.py demo --settings default  # the demo's questions against exact

``prose``: the fidelity report on a split of the real-prose suite, in slices saved as they finish
(``--jobs N`` processes claim slices by claim files), then one table beside the order floor.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import _common  # noqa: F401  (the repository root on sys.path: benchmarks/_common.py)
import torch

from benchmarks.fidelity.corpus import build_corpus, build_prompts
from benchmarks.fidelity.oracle import (  # noqa: F401  (the tests reach the oracle through this module too)
    ORACLE_SELECTIONS,
    _oracle_log_start,
    _oracle_picks,
    _wants_oracle,
    full_context_kv,
    install_oracle_selection,
    oracle_summary,
)
from benchmarks.fidelity.settings import (  # noqa: F401  (and the grid, through this module)
    SAME_TOKENS,
    SELECTION,
    THRESHOLDS,
    Setting,
    _neutral,
    available_options,
    build_settings,
    check_thresholds,
    grid_settings,
    markdown_table,
    recovery_available,
)
from lazyllm import LazyLLM
from lazyllm.errors import LazyLLMError, UnsupportedModelError
from lazyllm.presets import PRESETS
from lazyllm.quality import kl_and_agreement  # the fidelity report's metric code

SYSTEM = "You are a helpful assistant. Answer the question briefly, using only the documents."

# -- measurement -----------------------------------------------------------------------
def _gen_items(prompts, args):
    return [dict(question=p.question, chunks=p.chunks, system=SYSTEM,
                 max_new_tokens=args.needle_tokens if p.kind == "needle" else args.answer_tokens)
            for p in prompts]


def _score_all(llm, prompts, continuations, workers: int) -> list:
    """``score`` of every prompt (logits included), ``workers`` requests in flight at once so
    that the engine batches their prefills; results in prompt order."""
    def one(i):
        p = prompts[i]
        return llm.score(p.question, chunks=p.chunks, system=SYSTEM, continuation=continuations[i],
                         return_logits=True)

    if workers <= 1:
        return [one(i) for i in range(len(prompts))]
    with ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, range(len(prompts))))


def _ttft(llm, prompts, n: int) -> list[float]:
    out = []
    for p in prompts[:n]:
        out.append(llm.generate(p.question, chunks=p.chunks, system=SYSTEM, max_new_tokens=1).ttft_s)
    return out


def run_reference(llm, prompts, args, log) -> list[dict]:
    t0 = time.perf_counter()
    gens = llm.generate_batch(_gen_items(prompts, args))
    refs = []
    scores = _score_all(llm, prompts, [list(g.token_ids) for g in gens], args.score_workers)
    for p, g, sc in zip(prompts, gens, scores):
        segs = g.prompt_segments
        refs.append(dict(ids=list(g.token_ids), text=g.text, logits=sc.logits, prefilled=sc.prefilled_tokens,
                         suffix_tokens=len(segs[-1][1]), chunk_tokens=sum(len(s) for k, s in segs if k == "chunk"),
                         prompt_tokens=g.usage.prompt_tokens,
                         needle_hit=(p.answer in g.text) if p.answer is not None else None))
    log(f"  reference: {len(prompts)} prompts in {time.perf_counter() - t0:.1f}s")
    return refs


def _needles(llm, prompts, refs, per_prompt, args) -> tuple[list[bool], int, int]:
    """Needle accuracy needs the setting's own greedy text: the needle prompts generated, each
    hit recorded in ``per_prompt``; the hits, the generations whose tokens disagree with the
    teacher-forced greedy match, and how many were checked."""
    needle_idx = [i for i, p in enumerate(prompts) if p.answer is not None]
    gens = llm.generate_batch(_gen_items([prompts[i] for i in needle_idx], args)) if needle_idx else []
    needle, mismatched = [], 0
    for i, g in zip(needle_idx, gens):
        pp, p, ref = per_prompt[i], prompts[i], refs[i]
        pp["needle_hit"] = p.answer in g.text
        pp["text"] = g.text
        needle.append(pp["needle_hit"])
        # cross-check of the teacher-forced greedy match against the real generation
        mismatched += pp["greedy_match"] != (list(g.token_ids) == ref["ids"])
    return needle, mismatched, len(gens)


def _per_kind(per_prompt) -> dict:
    """Top-1, KL (token-weighted) and greedy match per question kind."""
    out = {}
    for kind in ("what", "cloze", "needle"):
        sel = [pp for pp in per_prompt if pp["kind"] == kind]
        if sel:
            tok = sum(pp["tokens"] for pp in sel)
            out[kind] = dict(prompts=len(sel), top1=sum(pp["top1"] * pp["tokens"] for pp in sel) / tok,
                             kl=sum(pp["kl"] * pp["tokens"] for pp in sel) / tok,
                             greedy_match=sum(pp["greedy_match"] for pp in sel) / len(sel))
    return out


def run_setting(llm, setting: Setting, prompts, refs, canonical, args, log) -> dict:
    t0 = time.perf_counter()
    if setting.reuse in ("lazy", "block"):
        llm.warm(canonical, system=SYSTEM, progress=False)  # in the canonical order: queries reuse at other positions
    t_warm = time.perf_counter() - t0
    kls, agrees, per_prompt, argmaxes = [], [], [], []
    extra_total = chunk_total = 0
    unexpected = 0
    scores = _score_all(llm, prompts, [r["ids"] for r in refs], args.score_workers)
    for p, ref, sc in zip(prompts, refs, scores):
        kl, ag = kl_and_agreement(ref["logits"], sc.logits)
        kls += kl
        agrees += ag
        argmaxes.append(sc.logits.argmax(-1).tolist())
        if setting.reuse in ("lazy", "block"):
            # warm: only the question (suffix) and the answer (less its last token) need computing
            extra = sc.prefilled_tokens - (ref["suffix_tokens"] + len(ref["ids"]) - 1)
        elif setting.is_reference:
            extra = 0
        else:  # full attention with prefix reuse (the exact preset): every chunk token is computed
            extra = ref["chunk_tokens"]
        if setting.recovery == "none" and extra != 0 and setting.reuse in ("lazy", "block"):
            unexpected += 1  # a chunk that was not cached (evicted?): counts as recomputed
        extra_total += extra
        chunk_total += ref["chunk_tokens"]
        per_prompt.append(dict(qid=p.qid, kind=p.kind, order=p.order, tokens=len(kl), kl=sum(kl) / len(kl),
                               top1=sum(ag) / len(ag), prefilled=sc.prefilled_tokens, extra=extra,
                               ref_ids=ref["ids"]))
    t_score = time.perf_counter() - t0 - t_warm
    # greedy match without generating: the setting's greedy answer equals the reference
    # answer token for token iff, teacher-forced on the reference answer, its argmax is the
    # reference token at every position (the contexts agree up to the first difference)
    for pp, ag_ids in zip(per_prompt, argmaxes):
        ref_ids = pp.pop("ref_ids")
        pp["greedy_match"] = ag_ids == ref_ids
        pp["same_answer"] = ag_ids[:SAME_TOKENS] == ref_ids[:SAME_TOKENS]
    needle, mismatched, n_checked = _needles(llm, prompts, refs, per_prompt, args)
    t_gen = time.perf_counter() - t0 - t_warm - t_score
    ttft = _ttft(llm, prompts, args.ttft_prompts)
    n = len(kls)
    res = dict(
        setting=setting.name, reuse=setting.reuse, chunk_context=setting.chunk_context, recovery=setting.recovery,
        kwargs=setting.kwargs, is_default=setting.is_default, is_reference=setting.is_reference,
        tokens=n, top1=sum(agrees) / n, kl=sum(kls) / n, kl_max=max(kls),
        greedy_match=sum(pp["greedy_match"] for pp in per_prompt) / len(per_prompt),
        same_answer=sum(pp["same_answer"] for pp in per_prompt) / len(per_prompt),
        needle_acc=(sum(needle) / len(needle)) if needle else None,
        recompute_frac=extra_total / chunk_total if chunk_total else 0.0,
        prefill_per_prompt=statistics.mean(pp["prefilled"] for pp in per_prompt),
        ttft_ms=statistics.median(ttft) * 1e3 if ttft else None, ttft_all_ms=[t * 1e3 for t in ttft],
        uncached_prompts=unexpected, greedy_check_mismatches=mismatched, greedy_checked=n_checked,
        time_s=dict(warm=t_warm, score=t_score, generate=t_gen, ttft=time.perf_counter() - t0 - t_warm - t_score
                    - t_gen),
        per_kind=_per_kind(per_prompt),
        prompts=per_prompt,
    )
    log(f"  {setting.name}: top-1 {res['top1']:.3f}, KL {res['kl']:.4f}, greedy {res['greedy_match']:.2f}, "
        f"recompute {res['recompute_frac']:.3f}  ({time.perf_counter() - t0:.1f}s)")
    return res


def run_cases(args, log) -> dict:
    """The fidelity report on a JSONL of cases (held-out or your own)."""
    from lazyllm.quality import compare

    settings = ["default"] + [p for p in (args.presets.split(",") if args.presets else PRESETS) if p]
    if args.settings_json:
        settings = [(n, None) for n in settings] + list(json.loads(args.settings_json).items())
    oracle = _wants_oracle(args)
    if oracle:
        install_oracle_selection()
        _oracle_log_start(True)
    llm = LazyLLM(args.model, device=args.device, dtype=args.dtype, reuse="none", kv_cache_bytes=args.kv_cache_mb
                  << 20, progress=False)
    try:
        rep = compare(llm, args.cases, settings, answer_tokens=args.answer_tokens, ttft_cases=args.ttft_prompts,
                      workers=args.score_workers, progress=not args.quiet, kv_cache_bytes=args.kv_cache_mb << 20)
    finally:
        llm.close()
    out = rep.to_dict()
    if oracle:
        out["oracle_picks"] = _oracle_picks(llm.tokenizer, log)
        _oracle_log_start(False)
    out.update(date=time.strftime("%Y-%m-%d"), command="python benchmarks/quality.py " + " ".join(
        sys.argv[1:]), table=rep.to_markdown(), device=str(llm.device), dtype=str(llm.dtype))
    log(out["table"])
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return out


# -- main ------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="subcommands, each with its own --help: prose (the real-prose fidelity "
                                        "report), prose-suite (build its cases), demo (the demo's questions)")
    ap.add_argument("--model", default=None, help="model folder / .gguf / hub id (default: the embedded SmolLM2)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--questions", type=int, default=16, help="document questions (what / cloze)")
    ap.add_argument("--needles", type=int, default=8, help="planted-fact questions")
    ap.add_argument("--orders", type=int, default=2, help="chunk orders per question (each a prompt)")
    ap.add_argument("--docs-per-prompt", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=64, help="document length in tokens (at most)")
    ap.add_argument("--answer-tokens", type=int, default=16, help="reference answer length (what / cloze)")
    ap.add_argument("--needle-tokens", type=int, default=20, help="reference answer length (needle)")
    ap.add_argument("--ttft-prompts", type=int, default=8, help="solo requests timed per setting")
    ap.add_argument("--modes", default="lazy,block")
    ap.add_argument("--contexts", default="isolated,prefix")
    ap.add_argument("--recoveries", default="none,first-4,first-16,first-32,ratio-0.05,ratio-0.15",
                    help="none, first-K (recompute_first_tokens=K), ratio-R (recompute_ratio=R, key deviation), "
                         "attn-R (recompute_ratio=R, recompute_selection='attention'), two-R ('two-stage'), "
                         "oracle-kv-R / oracle-attn-R / oracle-kvattn-R / oracle-effect-R (an upper bound that "
                         "reads full attention's KV and attention: measurement only), joined by +")
    ap.add_argument("--score-workers", type=int, default=8,
                    help="score requests in flight at once (batched by the engine; 1: one at a time)")
    ap.add_argument("--kv-cache-mb", type=int, default=512, help="KV pool per engine")
    ap.add_argument("--presets", default="", help=f"comma-separated LazyLLM(quality=...) presets to add: "
                                                  f"{','.join(PRESETS)}")
    ap.add_argument("--cases", default=None,
                    help="a JSONL of your own cases (question, documents, system, reference): run the fidelity "
                         "report (lazyllm.quality.compare) on it instead, with --presets (default: all) and "
                         "--settings-json")
    ap.add_argument("--settings-json", default=None,
                    help="extra settings, a JSON object {name: LazyLLM kwargs}")
    ap.add_argument("--no-self-check", action="store_true", help="skip full attention scored against itself")
    ap.add_argument("--no-default", action="store_true", help="skip LazyLLM()'s own setting")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="small slice for CI: 4 questions + 2 needles, one order, lazy only, recovery none / "
                         "first-16 (explicit flags still win)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        quick = {"--questions": ("questions", 4), "--needles": ("needles", 2), "--orders": ("orders", 1),
                 "--ttft-prompts": ("ttft_prompts", 2), "--modes": ("modes", "lazy"),
                 "--recoveries": ("recoveries", "none,first-16")}
        for flag, (attr, val) in quick.items():
            if flag not in given:
                setattr(args, attr, val)
    return args


SUBCOMMANDS = {"prose": "benchmarks.fidelity.report", "prose-suite": "benchmarks.fidelity.suite",
               "demo": "benchmarks.fidelity.demo"}


def reference_run(ref_llm, prompts, args, log) -> tuple[list[dict], dict]:
    """Full attention, cold: each prompt's reference, and the reference row."""
    ref_llm.generate("Warm-up question?", chunks=["A warm-up document."], max_new_tokens=1)
    refs = run_reference(ref_llm, prompts, args, log)
    ref_ttft = _ttft(ref_llm, prompts, args.ttft_prompts)
    ref_needles = [r["needle_hit"] for r in refs if r["needle_hit"] is not None]
    reference = dict(needle_acc=sum(ref_needles) / len(ref_needles) if ref_needles else None,
                     ttft_ms=statistics.median(ref_ttft) * 1e3, ttft_all_ms=[t * 1e3 for t in ref_ttft],
                     prefill_per_prompt=statistics.mean(r["prefilled"] for r in refs),
                     prompt_tokens=statistics.mean(r["prompt_tokens"] for r in refs),
                     chunk_tokens=statistics.mean(r["chunk_tokens"] for r in refs),
                     answers=[dict(qid=p.qid, kind=p.kind, order=p.order, question=p.question, answer=p.answer,
                                   text=r["text"], needle_hit=r["needle_hit"]) for p, r in zip(prompts, refs)])
    ref_llm.close()
    return refs, reference


def run_settings(settings, skipped: list, model, data, args, log) -> list[dict]:
    """Each setting's row over ``data`` (prompts, their references, the distinct chunks and
    the reference row), on ``model`` (weights, tokenizer, KV bytes); a setting that cannot be
    built or fails is added to ``skipped``."""
    hf, tok, kv_bytes = model
    prompts, refs, canonical, reference = data
    results = []
    for s in settings:
        try:
            llm = LazyLLM(model=hf, tokenizer=tok, kv_cache_bytes=kv_bytes, progress=False, **s.kwargs)
        except (TypeError, LazyLLMError, ValueError) as e:
            skipped.append({"setting": s.name, "reason": f"{type(e).__name__}: {e}"})
            log(f"note: {s.name} skipped: {e}")
            continue
        oracle = s.kwargs.get(SELECTION) in ORACLE_SELECTIONS
        try:
            llm.generate("Warm-up question?", chunks=["A warm-up document."], max_new_tokens=1)
            _oracle_log_start(oracle)
            res = run_setting(llm, s, prompts, refs, canonical, args, log)
            if oracle:
                res["oracle_picks"] = _oracle_picks(tok, log)
        except (LazyLLMError, NotImplementedError) as e:
            skipped.append({"setting": s.name, "reason": f"{type(e).__name__}: {e}"})
            log(f"note: {s.name} failed: {e}")
            continue
        finally:
            _oracle_log_start(False)
            llm.close()
            del llm
            gc.collect()
        res.update(check_thresholds(res, reference["needle_acc"], args.chunk_tokens))
        results.append(res)
    for sk in skipped:
        log(f"skipped: {sk['setting']}: {sk['reason']}")
    return results


def _reference_llm(args, kv_bytes: int):
    """Full attention's engine, or (the model cannot be loaded) the error, also printed."""
    try:
        return LazyLLM(args.model, device=args.device, dtype=args.dtype, reuse="none", kv_cache_bytes=kv_bytes,
                       progress=False)
    except LazyLLMError as e:  # UnsupportedModelError, ModelLoadError, ...
        unsupported = isinstance(e, UnsupportedModelError)
        what = "is not supported by lazyllm" if unsupported else "could not be loaded"
        msg = f"model {args.model or 'default'!r} {what}: {e}"
        print(f"{'UNSUPPORTED' if unsupported else 'ERROR'}: {msg}", file=sys.stderr)
        out = dict(error=msg, unsupported=unsupported, model=args.model)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        return out


def _report(out: dict, args, log) -> None:
    """The table (also into ``out``), what was not measured, and the JSON."""
    out["table"] = markdown_table(out)
    log("")
    log(f"Fidelity to full attention ({out['model_name'] or out['model']}, {out['device']}, {out['dtype']}; "
        f"{out['n_prompts']} prompts, {args.docs_per_prompt} documents of <= {args.chunk_tokens} tokens; "
        f"{out['date']})")
    log(out["table"])
    if out["skipped"]:
        log("\nNot measured: " + "; ".join(f"{s['setting']} ({s['reason']})" for s in out["skipped"]))
    log(f"\nwall time {out['wall_s']:.0f}s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in SUBCOMMANDS:
        importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
        return {}
    args = parse_args(argv)
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    t_start = time.perf_counter()
    if args.cases:
        return run_cases(args, log)
    if _wants_oracle(args):
        install_oracle_selection()
    opts = available_options()
    rec_avail = recovery_available(opts)
    kv_bytes = args.kv_cache_mb << 20
    ref_llm = _reference_llm(args, kv_bytes)
    if isinstance(ref_llm, dict):  # the model could not be loaded: why
        return ref_llm
    hf, tok = ref_llm.hf_model, ref_llm.tokenizer
    count = ref_llm.count_tokens
    docs = build_corpus(count, args.chunk_tokens)
    prompts, canonical = build_prompts(docs, questions=args.questions, needles=args.needles,
                                       docs_per_prompt=args.docs_per_prompt, orders=args.orders, seed=args.seed)
    corpus_hash = hashlib.blake2b("\x00".join(canonical).encode(), digest_size=8).hexdigest()
    log(f"model {ref_llm.model_name} on {ref_llm.device} ({ref_llm.dtype}); {len(docs)} candidate documents of "
        f"<= {args.chunk_tokens} tokens; {len(prompts)} prompts ({args.questions} questions + {args.needles} needles "
        f"x {args.orders} orders, {args.docs_per_prompt} documents each); {len(canonical)} distinct chunks")
    for k, ok in rec_avail.items():
        if not ok:
            log(f"note: LazyLLM has no `{k}` option (yet): its settings are skipped")
    settings, skipped = grid_settings(args, opts, log)
    # reference: full attention, cold
    refs, reference = reference_run(ref_llm, prompts, args, log)
    results = run_settings(settings, skipped, (hf, tok, kv_bytes), (prompts, refs, canonical, reference), args, log)

    out = dict(
        date=time.strftime("%Y-%m-%d"), command="python benchmarks/quality.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        model=args.model or "default", model_name=str(getattr(hf.config, "_name_or_path", "")),
        device=str(next(hf.parameters()).device), dtype=str(next(hf.parameters()).dtype),
        torch_threads=torch.get_num_threads(), python=platform.python_version(), corpus_hash=corpus_hash,
        config={k: v for k, v in vars(args).items() if k not in ("json", "quiet")},
        thresholds=THRESHOLDS, options_available=rec_avail,
        lazyllm_defaults={k: v for k, v in opts.items() if not _neutral(k)},
        n_prompts=len(prompts), n_chunks=len(canonical), reference=reference, results=results, skipped=skipped,
        wall_s=None,
    )
    out["wall_s"] = time.perf_counter() - t_start
    _report(out, args, log)
    return out


if __name__ == "__main__":
    res = main()
    sys.exit(2 if res.get("unsupported") else (1 if res.get("error") else 0))
