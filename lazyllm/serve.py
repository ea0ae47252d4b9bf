"""``python -m lazyllm.serve [model] [--host 127.0.0.1] [--port 8000] ...``: the OpenAI-compatible
server (``lazyllm.integrations.server``); the same as ``lazyllm serve``."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from lazyllm.cli import main as cli

    return cli(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
