"""``lazyllm serve``: the command line of the OpenAI-compatible server."""
from __future__ import annotations

import argparse
import logging
from typing import Any

from lazyllm import LazyLLM

from .app import create_app, log
from .protocol import (
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_MAX_NEW_TOKENS_LIMIT,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_TOKENS,
)


def build_parser(prog: str = "lazyllm serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Serve a LazyLLM over an OpenAI-compatible HTTP API.")
    p.add_argument("model", nargs="?", default=None,
                   help="transformers folder, .gguf file or hub id (default: the embedded default model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer <key> on /v1 (default: the LAZYLLM_API_KEY variable)")
    p.add_argument("--model-name", default=None, help="the id clients send as `model` (default: the model's)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    p.add_argument("--max-tokens-limit", type=int, default=DEFAULT_MAX_NEW_TOKENS_LIMIT,
                   help="the most max_tokens a request may ask")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY)
    p.add_argument("--reuse", default="lazy", choices=["lazy", "block", "prefix", "none"])
    p.add_argument("--chunk-context", default="isolated", choices=["isolated", "prefix"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--kv-disk-dir", default=None, help="persistent chunk KV tier (survives restarts)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", default="info")
    p.add_argument("--no-access-log", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    """``lazyllm serve [model] [--host 127.0.0.1] [--port 8000] [--api-key KEY] ...``"""
    import os

    import uvicorn

    args = build_parser().parse_args(argv)
    api_key = args.api_key or os.environ.get("LAZYLLM_API_KEY") or None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("binding to %s without an API key: anyone who can reach it can use it", args.host)
    kw: dict[str, Any] = dict(reuse=args.reuse, chunk_context=args.chunk_context, device=args.device,
                              dtype=args.dtype, kv_cache_bytes=args.kv_cache_bytes, page_size=args.page_size,
                              trust_remote_code=args.trust_remote_code)
    if args.kv_disk_dir:
        kw["kv_disk_dir"] = args.kv_disk_dir
    llm = LazyLLM(args.model, **kw)
    app = create_app(llm, api_key=api_key, model_name=args.model_name, max_request_bytes=args.max_request_bytes,
                     max_new_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
                     max_concurrency=args.max_concurrency)
    log.info("serving %s on http://%s:%d/v1", app.state.model_name, args.host, args.port)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    access_log=not args.no_access_log)
    finally:
        llm.close()
    return 0
