"""``python -m lazyllm.serve [model] [--host 127.0.0.1] [--port 8000] ...``: the OpenAI-compatible
server (``lazyllm.integrations.server``); the same as ``lazyllm serve``."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from lazyllm.integrations.server import main as serve

    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
