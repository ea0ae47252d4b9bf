"""The ``lazyllm`` command. Subcommands:

- ``lazyllm serve [model] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...``: an
  OpenAI-compatible server (``lazyllm serve --help`` lists the options).
- ``lazyllm adapt DOCUMENTS --out PACKET [--model M] ...``: train a chunk packet on your
  documents and print the fidelity report before and after (``lazyllm adapt --help``).
- ``lazyllm quality CASES [--settings ...]``: the fidelity report
  (``python -m lazyllm.quality``).

Each command checks its arguments with light imports only: a bad flag is a one-line usage
error in well under a second, before torch, transformers or the engine are imported.
"""
from __future__ import annotations

import sys

USAGE = """usage: lazyllm <command> [options]
       lazyllm --version

commands:
  serve    serve a model over an OpenAI-compatible HTTP API (lazyllm serve --help)
  adapt    train a chunk packet on your documents for fidelity without recompute (lazyllm adapt --help)
  quality  the fidelity report of reuse settings on your cases (lazyllm quality --help)
"""


def main(argv: list[str] | None = None) -> int:
    """``lazyllm <command> [options]``: the exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args:  # no command is a usage error, as argparse makes it for a subcommand's arguments
        print(USAGE, end="", file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if args[0] in ("-V", "--version"):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"lazyllm {version('lazyattention')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            print("lazyllm (not installed: no version)")
        return 0
    command, rest = args[0], args[1:]
    if command == "serve":
        from lazyllm.extras import MissingExtraError

        try:
            from lazyllm.integrations.server import main as serve
        except MissingExtraError as e:
            print(f"lazyllm serve: {e}", file=sys.stderr)
            return 2
        return serve(rest)
    if command == "adapt":
        return adapt_main(rest)
    if command == "quality":
        from lazyllm.quality.cli import main as quality

        quality(rest, prog="lazyllm quality")
        return 0
    print(f"lazyllm: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


def adapt_parser():
    """``lazyllm adapt``'s arguments, with ``adapt``'s defaults (so the two entry points train
    the same recipe)."""
    import argparse

    from lazyllm.options import option_help
    from lazyllm.quality.checks import ADAPT_DEFAULTS as dflt

    ap = argparse.ArgumentParser(prog="lazyllm adapt", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 description="Train a learned chunk packet on your documents "
                                 "(self-distillation from full attention, no labels) and report fidelity on "
                                 "held-out documents before and after.")
    ap.add_argument("documents", help="a JSONL file, a folder of .txt/.md files, or one text file")
    ap.add_argument("--out", default="packets.safetensors", help="packet file to write")
    ap.add_argument("--model", default=None, help="model path or hub id (default: the embedded model)")
    ap.add_argument("--device", default="auto", help=option_help("device"))
    ap.add_argument("--k-header", type=int, default=dflt["k_header"], help="packet embeddings before each chunk")
    ap.add_argument("--k-trailer", type=int, default=dflt["k_trailer"], help="packet embeddings after each chunk")
    ap.add_argument("--cases", type=int, default=dflt["cases"], help="training cases")
    ap.add_argument("--heldout", type=float, default=dflt["heldout"], help="fraction of documents held out")
    ap.add_argument("--heldout-cases", type=int, default=dflt["heldout_cases"], help="cases for the held-out report")
    ap.add_argument("--questions", choices=("templates", "model", "mixed"), default=dflt["questions"],
                    help="the training questions: from templates, written by the model per document, or both")
    ap.add_argument("--steps", type=int, default=dflt["steps"], help="Adam steps, one case each")
    ap.add_argument("--minutes", type=float, default=dflt["minutes"], help="training time limit")
    ap.add_argument("--lr", type=float, default=dflt["lr"], help="learning rate")
    ap.add_argument("--no-report", action="store_true", help="skip the fidelity report")
    ap.add_argument("--json", default=None, help="write the report and the training log here")
    ap.add_argument("--seed", type=int, default=0, help="seed of the document split, the cases and the training")
    return ap


def adapt_main(argv: list[str]) -> int:
    """``lazyllm adapt``: arguments of ``lazyllm.quality.adapt``."""
    import json
    from pathlib import Path

    from lazyllm.errors import InvalidRequestError
    from lazyllm.quality.checks import ADAPT_DEFAULTS as dflt
    from lazyllm.quality.checks import check_recipe

    ap = adapt_parser()
    a = ap.parse_args(argv)
    # every argument checked before torch is imported, the model loads and training starts (minutes)
    try:
        check_recipe(k_header=a.k_header, k_trailer=a.k_trailer, cases=a.cases, heldout=a.heldout,
                     heldout_cases=a.heldout_cases, docs_per_case=dflt["docs_per_case"], steps=a.steps,
                     minutes=a.minutes, lr=a.lr, out=a.out)
    except InvalidRequestError as e:
        ap.error(str(e))
    if not Path(a.documents).expanduser().exists():
        ap.error(f"documents: {a.documents!r} does not exist")
    from lazyllm import LazyLLM
    from lazyllm.quality.adapt import adapt

    try:
        llm = LazyLLM(a.model, device=a.device, reuse="none", packets=None, kv_cache_bytes=256 << 20)
        res = adapt(llm, a.documents, out=a.out, questions=a.questions, k_header=a.k_header, k_trailer=a.k_trailer,
                    cases=a.cases, heldout=a.heldout, heldout_cases=a.heldout_cases, steps=a.steps,
                    minutes=a.minutes, lr=a.lr, report=not a.no_report, seed=a.seed)
    except InvalidRequestError as e:
        print(f"lazyllm adapt: {e}", file=sys.stderr)
        return 2
    print(res._repr_markdown_())
    print(f"\nuse it: LazyLLM(packets={res.path!r})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(path=res.path, split=res.split, heldout_loss_before=res.heldout_loss_before,
                           heldout_loss_after=res.heldout_loss_after, losses=res.log.get("losses"),
                           seconds=res.log.get("seconds"), report=res.report.to_dict() if res.report else None),
                      f, indent=1, default=str)
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
