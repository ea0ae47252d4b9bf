"""``python -m lazyllm.quality`` (or ``lazyllm quality``): the fidelity report from a shell.

Every argument is checked with light imports only (no torch, no engine): a bad one is a
usage error in well under a second, before the model loads or a case is measured."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..extras import MissingExtraError, require
from ..options import option_help
from ..presets import PRESETS
from .cases import load_cases
from .checks import DEFAULT_SETTINGS, check_settings
from .metrics import parse_target

if TYPE_CHECKING:
    from .report import FidelityReport


def _parse_settings(text: str) -> list:
    if "{" not in text:
        return [s.strip() for s in text.split(",") if s.strip()]
    settings = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, kw = part.partition("=")
        settings.append((name.strip(), json.loads(kw)) if kw else (name.strip(), None))
    return settings


def _packet_settings(paths: Sequence[str]) -> list[tuple[str, dict]]:
    """One setting per ``--packets`` file: the default options with that packet, named after
    the file (``mine.pt`` -> ``mine``); raises ``OSError`` for a file that is not there."""
    from pathlib import Path

    out = []
    for p in paths:
        if not Path(p).is_file():
            raise OSError(f"--packets {p}: no such packet file")
        name = Path(p).stem
        out.append((name if name not in {n for n, _ in out} else f"{name}-{len(out) + 1}", {"packets": str(p)}))
    return out


def build_parser(prog: str = "python -m lazyllm.quality") -> argparse.ArgumentParser:
    """The fidelity report's arguments."""
    ap = argparse.ArgumentParser(prog=prog,
                                 description="Fidelity of lazyllm's reuse settings to full attention on your cases.")
    ap.add_argument("cases", help="JSONL: question, documents, optional system and reference")
    ap.add_argument("--model", default=None, help="model folder / .gguf / hub id (default: the embedded model)")
    ap.add_argument("--device", default="auto", help=option_help("device"))
    ap.add_argument("--settings", default=",".join(DEFAULT_SETTINGS),
                    help=f"comma-separated: 'default' and presets {tuple(PRESETS)}, or name=JSON kwargs "
                         "separated by ';' (e.g. 'r30={\"quality\":\"balanced\",\"recompute_ratio\":0.3}')")
    ap.add_argument("--packets", action="append", default=[], metavar="FILE",
                    help="also measure the default options with this packet file (from lazyllm adapt); the setting "
                         "is named after the file; repeat the flag to compare several")
    ap.add_argument("--target", default=None,
                    help="what a setting must reach, e.g. top1>=0.97,kl<=0.01,same>=0.9 (the default); fractions "
                         "in [0, 1] ('=' works too: each metric's direction is its own)")
    ap.add_argument("--answer-tokens", type=int, default=16, help="length of the answers compared (tokens)")
    ap.add_argument("--same-answer-tokens", type=int, default=8,
                    help="leading tokens that must agree for 'same answer'")
    ap.add_argument("--ttft-cases", type=int, default=8, help="cases timed per setting")
    ap.add_argument("--orders", type=int, default=4,
                    help="the order floor: full attention under this many distinct other orders of each case's "
                         "documents (0: none)")
    ap.add_argument("--system", default=None, help="system prompt for cases without one")
    ap.add_argument("--markdown", default=None, help="write the table here")
    ap.add_argument("--json", default=None, help="write the full report here")
    ap.add_argument("--plot", default=None, help="write the plot here (PNG; needs matplotlib, the bench extra)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    return ap


def main(argv: Sequence[str] | None = None, prog: str = "python -m lazyllm.quality") -> FidelityReport:
    """Check the arguments, then measure and print the report (and write the files asked for)."""
    ap = build_parser(prog)
    a = ap.parse_args(argv)
    # everything that can be wrong with the arguments is found before the model loads
    try:
        if a.plot:
            require("bench", "matplotlib")
        cases = load_cases(a.cases)
        if not cases:
            raise ValueError(f"{a.cases}: no cases")
        settings = _parse_settings(a.settings) + _packet_settings(a.packets)
        check_settings(settings)
        target = parse_target(a.target)
        if a.orders < 0:
            raise ValueError(f"--orders must be >= 0, got {a.orders}")
    except (OSError, ValueError, TypeError, MissingExtraError) as e:
        ap.error(str(e))
    from lazyllm import LazyLLM

    from .report import compare

    t0 = time.perf_counter()
    llm = LazyLLM(a.model, device=a.device, reuse="none", kv_cache_bytes=256 << 20, progress=not a.no_progress)
    try:
        report = compare(llm, cases, settings, target, system=a.system, answer_tokens=a.answer_tokens,
                         same_answer_tokens=a.same_answer_tokens, ttft_cases=a.ttft_cases, orders=a.orders,
                         progress=not a.no_progress)
    finally:
        llm.close()
    md = report.full_markdown()
    print(md)
    print(f"\n({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
    if a.markdown:
        with open(a.markdown, "w", encoding="utf-8") as f:
            f.write(md + "\n")
    if a.json:
        report.to_json(a.json)
    if a.plot:
        report.plot(path=a.plot)
    return report
