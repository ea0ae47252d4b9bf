"""The ``lazyllm`` command. Subcommands:

- ``lazyllm serve [model] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...``: an
  OpenAI-compatible server (``lazyllm serve --help`` lists the options).
"""
from __future__ import annotations

import sys

USAGE = """usage: lazyllm <command> [options]

commands:
  serve    serve a model over an OpenAI-compatible HTTP API (lazyllm serve --help)
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command, rest = args[0], args[1:]
    if command == "serve":
        from lazyllm.integrations.server import main as serve

        return serve(rest)
    print(f"lazyllm: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
