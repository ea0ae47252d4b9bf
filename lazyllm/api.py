"""``LazyLLM``: the public entry point."""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import inspect
import os
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .cache.store import ChunkStore, PagePool
from .config import QUALITY_OPTIONS, EngineConfig, options_docstring, resolve_page_size, warm_skipped
from .config import resolve_device as _resolve_device
from .config import resolve_dtype as _resolve_dtype
from .engine.engine import Engine
from .engine.request import Request
from .engine.warmup import heap
from .engine.warmup.compiles import COMPILES, default_triton_cache
from .engine.warmup.driver import Readiness
from .errors import InvalidRequestError
from .inputs import InputProcessor, check_text, prompt_builder
from .inputs.encodings import ChunkEncodings
from .model.attention import make_backend
from .model.identity import fingerprint
from .model.llama import LlamaFamilyModel
from .model.loader import eos_token_ids, load_hf
from .model.packets import resolve_packets
from .option_spec import options_signature
from .stream import TextStream
from .types import DEFAULT_MAX_NEW_TOKENS, Chunk, GenerationOutput, ScoreOutput, as_chunk


def _from_config(name: str) -> property:
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}``")


def _signature(config_cls: type = EngineConfig) -> inspect.Signature:
    """``LazyLLM.__init__``'s: the model arguments, then every option of ``config_cls`` with its
    default (``None``, "not given", for those a preset sets)."""
    kw = inspect.Parameter.KEYWORD_ONLY
    head = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("model_name_or_path", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None,
                              annotation="str | None"),
            inspect.Parameter("model", kw, default=None, annotation="Any"),
            inspect.Parameter("tokenizer", kw, default=None, annotation="Any")]
    return options_signature(config_cls, head, set(QUALITY_OPTIONS))


_LIVE_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()
_LIVE_TP_GROUPS: weakref.WeakSet = weakref.WeakSet()  # tensor-parallel workers, stopped after the engines


@atexit.register
def _close_engines() -> None:
    for engine in list(_LIVE_ENGINES):
        with contextlib.suppress(Exception):  # best effort at exit
            engine.close()
    for group in list(_LIVE_TP_GROUPS):
        with contextlib.suppress(Exception):
            group.close()


class LazyLLM:
    """An in-process LLM that takes retrieved documents as chunks and reuses each chunk's
    KV across requests, at any position and in any order.

    Parameters
    ----------
    model_name_or_path : a folder with a transformers checkpoint, a ``.gguf`` file, a hub
        id (the only case that uses the network), or ``None`` for the embedded default
        model (SmolLM2-135M-Instruct, offline).
    model, tokenizer : an already loaded transformers causal LM and its tokenizer,
        instead of ``model_name_or_path``. Its weights are used in place, not copied.
    Every other argument is an engine option, declared once in ``lazyllm.options`` and
    validated by ``lazyllm.config.EngineConfig`` (``llm.config`` is the running
    configuration); a ``quality`` preset sets several, and options passed explicitly
    override it:

    """

    _pool: ThreadPoolExecutor | None = None  # generate_batch's request builders, made on first use

    def __init__(self, model_name_or_path: str | None = None, *, model: Any = None, tokenizer: Any = None,
                 **options: Any):
        # the options are EngineConfig's fields: ``__signature__`` (below) lists each with its
        # default, and binding to it refuses an unknown keyword as Python does (TypeError)
        try:
            LazyLLM.__init__.__signature__.bind(self, model_name_or_path, model=model, tokenizer=tokenizer, **options)
        except TypeError as e:
            raise TypeError(f"LazyLLM(): {e}") from None
        config = EngineConfig.resolve(**options)
        self._tp = None
        self._load(config, model_name_or_path, model, tokenizer)
        # an engine thread still inside torch at interpreter shutdown can abort the
        # process: stop it first (weakly referenced, so the LazyLLM can still be freed)
        _LIVE_ENGINES.add(self.engine)
        self._readiness = Readiness()
        self._readiness.begin(self.warmup if config.warmup else None)  # the warm-up, else ready at once

    def _load(self, config: EngineConfig, model_name_or_path, model, tokenizer) -> None:
        """Load the model, the attention backend, the page pool and the engine for ``config``;
        ``self.config`` ends as the running configuration, with the load-time choices in."""
        self.config = config
        hf, tok = self._load_model(config, model_name_or_path, model, tokenizer)
        try:
            backend = make_backend(config.attention_backend, self.device, batch_invariant=config.batch_invariant,
                                   options=config.kernel_options, calibration=config.calibration)
        except ImportError as e:
            raise InvalidRequestError(f"attention_backend='triton' needs triton: {e}") from None
        if backend.name == "triton" and self.device.type == "cuda":
            default_triton_cache()  # read by Triton at each compile: set before the first
            COMPILES.install()
        page_size = resolve_page_size(config.page_size, self.device, backend.name)
        self.hf_model, self.tokenizer = hf, tok
        runner = {"cuda_graphs": config.cuda_graphs}
        if config.tensor_parallel > 1:
            from .engine.running.tp_runner import TensorParallelRunner, start_group

            self._check_tensor_parallel(hf.config)
            # the workers load a checkpoint themselves; a model passed in travels to them
            # (CPU tensors through shared memory, CUDA tensors through CUDA IPC)
            source = hf if model is not None else ("load", model_name_or_path, config.trust_remote_code)
            self._tp, self.model = start_group(
                config.tensor_parallel, hf, source, backend, self.device, self.dtype, live=_LIVE_TP_GROUPS,
                attention_backend=config.attention_backend, batch_invariant=config.batch_invariant,
                kernel_options=config.kernel_options)
            runner["runner_cls"] = TensorParallelRunner
        else:
            self.model = LlamaFamilyModel(hf, attention=backend, batch_invariant=config.batch_invariant)
        self.model_fingerprint = fingerprint(self.model)
        self.packets = resolve_packets(config.packets, self.model, self.chunk_context, auto=config.packets_fit)
        # cache keys and the disk tier separate packet versions: a packet changes every chunk's KV
        self.fingerprint = self.model_fingerprint + (f":packets:{self.packets.digest}" if self.packets else "")
        kv_cache_bytes = self._make_store(page_size, config.kv_cache_bytes)
        self.prompts = prompt_builder(tok, config.prompt_layout,
                                      self.packets.ids(self.model.embed_rows) if self.packets else None,
                                      encodings=ChunkEncodings())
        self.inputs = InputProcessor(tok, self.prompts, max_context=self.model.spec.max_context,
                                     vocab_size=self.model.spec.vocab_size, config=config,
                                     fingerprint=self.fingerprint)
        self.eos_token_ids = eos_token_ids(hf, tok)
        self.config = config.replace(device=str(self.device), dtype=str(self.dtype).removeprefix("torch."),
                                     attention_backend=backend.name, page_size=page_size,
                                     kv_cache_bytes=kv_cache_bytes)
        self.engine = Engine(self.model, tok, self.store, self.config, fingerprint=self.fingerprint,
                             eos_ids=self.eos_token_ids, rerotate_copy=backend.rerotate_copy, disk=self._open_disk(),
                             bridge_tokens=self.packets.bridge_tokens if self.packets else 0, **runner)

    def _load_model(self, config: EngineConfig, model_name_or_path, model, tokenizer):
        """The transformers model and tokenizer, given or loaded; sets ``device``, ``dtype``
        and ``model_name``."""
        if model is not None:
            if tokenizer is None:
                raise InvalidRequestError("model= needs tokenizer= too")
            if model_name_or_path is not None:
                raise InvalidRequestError("give either model_name_or_path or model=, not both")
            p = next(model.parameters())
            self.device, self.dtype = p.device, p.dtype
            self.model_name = getattr(model.config, "_name_or_path", None) or type(model).__name__
            return model, tokenizer
        self.device = _resolve_device(config.device)
        self.dtype = _resolve_dtype(config.dtype, self.device)
        # with tensor_parallel, on the CPU: each rank moves only its shard to its GPU
        hf, tok, self.model_name = load_hf(
            model_name_or_path, device="cpu" if config.tensor_parallel > 1 else str(self.device), dtype=self.dtype,
            trust_remote_code=config.trust_remote_code, progress=config.progress)
        return hf, tok

    def _make_store(self, page_size: int, kv_cache_bytes: int | None) -> int:
        """The page pool (``kv_cache_bytes``, ``None``: 40% of free GPU memory, 1 GiB on CPU)
        and its chunk store; returns the byte budget used."""
        spec = self.model.spec
        page_bytes = PagePool.page_bytes(spec.num_layers, spec.num_kv_heads, spec.head_dim, page_size, self.dtype)
        if kv_cache_bytes is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                kv_cache_bytes = int(free * 0.4)
            else:
                kv_cache_bytes = 1 << 30
        try:
            pool = PagePool(spec.num_layers, spec.num_kv_heads, spec.head_dim, page_size=page_size,
                            num_pages=kv_cache_bytes // page_bytes, dtype=self.dtype, device=self.device)
            if self._tp is not None:
                self._tp.start_pools(pool)  # the same page count on every rank
        except BaseException:
            if self._tp is not None:
                self._tp.close()
            raise
        self.store = ChunkStore(pool)
        return kv_cache_bytes

    def _check_tensor_parallel(self, cfg) -> None:
        from .engine.running.tp_runner import check_group

        check_group(self.tensor_parallel, cfg, self.device)

    def _open_disk(self):
        from .cache.disk import DiskKVStore

        c = self.config
        return None if c.kv_disk_dir is None else DiskKVStore(
            c.kv_disk_dir, c.kv_disk_bytes, fingerprint=self.fingerprint,
            settings={"chunk_context": c.chunk_context, "dtype": str(self.dtype)})

    # -- requests ------------------------------------------------------------------
    @staticmethod
    def _wait(req: Request) -> GenerationOutput:
        while True:
            kind, val = req.events.get()
            if kind == "done":
                return val
            if kind == "error":
                raise val

    def generate(self, question: str | None = None, chunks: Sequence[str | Chunk] | None = None,
                 system: str | None = None, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 timeout: float | None = None, response_format: Any = None, tools: Sequence[dict] | None = None,
                 tool_choice: str | dict | None = None, messages: Sequence[dict] | None = None,
                 parallel_tool_calls: bool = False, logprobs: bool = False, top_logprobs: int = 0,
                 raw: bool = False, received_at: float | None = None) -> GenerationOutput:
        """Answer ``question`` over ``chunks`` (each a ``str`` or ``Chunk``), or the conversation
        ``messages`` (then ``question`` may be left out).

        Returns a ``GenerationOutput`` with ``text``, ``token_ids``, ``prompt_segments``,
        ``usage`` (``prompt_tokens``, ``cached_tokens``, ``completion_tokens``) and
        ``ttft_s`` (from this call, or from ``received_at``, a ``time.perf_counter()`` value such as a
        server's receipt of the request, to the first token; ``engine_ttft_s`` is the engine's
        part). Raises ``InvalidRequestError`` for bad input, ``ContextLengthError``
        when the request does not fit the model's context, ``RequestCancelled`` when
        ``timeout`` (seconds) passes first.

        Structured output and tools (the output is held to a grammar token by token):

        - ``response_format``: a Pydantic model class, a JSON Schema dict, OpenAI's
          ``{"type": "json_schema", "json_schema": {...}}`` or ``{"type": "json_object"}``,
          ``lazyllm.Regex(pattern)``, a list of allowed strings, or ``lazyllm.Grammar(text)``
          (Lark or GBNF). ``output.parsed`` holds the Pydantic instance / dict / str.
        - ``tools``: OpenAI function tools (``{"type": "function", "function": {"name",
          "description", "parameters"}}``); ``tool_choice``: ``"auto"`` (text or calls),
          ``"required"`` (at least one call), ``"none"`` or a tool name (that tool, forced).
          Calls come back in ``output.tool_calls`` (``lazyllm.ToolCall(id, name, arguments)``)
          with ``finish_reason == "tool_calls"``; one call per answer unless
          ``parallel_tool_calls`` (then one or more, a line each).
        - ``messages``: the conversation so far, OpenAI-shaped (``role`` system / user /
          assistant with ``tool_calls`` / tool with ``tool_call_id``); ``question``, when given,
          is appended as the last user turn. ``chunks`` attach to the first user message (or a
          message may carry its own ``"chunks"``), so an agent's steps reuse their KV. Earlier
          turns are chat-template turns with tools or tool turns, else folded into the question
          (``lazyllm.inputs.conversation.keeps_turns``, the rule the adapters and server follow).

        When ``max_new_tokens`` ends the answer first, ``finish_reason`` is ``"length"``,
        ``parsed`` is None and ``text`` holds the partial output.

        ``logprobs=True``: ``output.logprobs`` holds each generated token's log-probability
        (``lazyllm.TokenLogprob``), and with ``top_logprobs=k`` (0-20) the ``k`` most likely
        tokens at each place: the model's own distribution, ``score``'s values for the same
        tokens (a teacher-forced pass over the answer once it is complete, reusing the
        prompt's KV).

        ``raw=True``: complete ``question`` as written (a text completion, OpenAI's legacy
        ``/v1/completions``): no chat template, the chunks before it, no ``system``.
        """
        req = self.inputs.generation(question, chunks, system, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, top_k=top_k, seed=seed, stop=stop, timeout=timeout,
                                     response_format=response_format, tools=tools, tool_choice=tool_choice,
                                     messages=messages, parallel_tool_calls=parallel_tool_calls, streaming=False,
                                     logprobs=logprobs, top_logprobs=top_logprobs, raw=raw,
                                     received_at=received_at)  # None: the front door stamps this call
        self.engine.submit(req)
        try:
            return self._wait(req)
        except BaseException:
            req.cancelled.set()
            raise

    __call__ = generate

    def stream(self, question: str | None = None, chunks=None, system=None, **kw) -> TextStream:
        """Like ``generate`` but yields text deltas as they are decoded; the returned
        ``TextStream`` also works with ``async for``, and has ``.output`` (the
        ``GenerationOutput``) once exhausted. Stopping the iteration (``break``,
        ``close()``) cancels the request and frees its pages."""
        return TextStream(self.engine, self.inputs.generation(question, chunks, system, **kw, streaming=True))

    async def agenerate(self, question: str | None = None, chunks=None, system=None, **kw) -> GenerationOutput:
        """Async ``generate``: cancelling the task cancels the request."""
        req = self.inputs.generation(question, chunks, system, **kw, streaming=False)
        loop = asyncio.get_running_loop()
        self.engine.submit(req)
        try:
            return await loop.run_in_executor(None, self._wait, req)
        except asyncio.CancelledError:
            req.cancelled.set()
            raise

    def astream(self, question: str | None = None, chunks=None, system=None, **kw) -> TextStream:
        """Async ``stream``: ``async for delta in llm.astream(...)``."""
        return self.stream(question, chunks, system, **kw)

    def generate_batch(self, requests: Sequence[dict | str], **common) -> list[GenerationOutput]:
        """Run many requests together (batched prefill and decode). Each item is a
        question string or a dict of ``generate`` arguments; ``common`` fills the rest.
        Bad input in any item raises before anything runs."""
        if isinstance(requests, (str, dict)) or not isinstance(requests, Sequence):
            raise InvalidRequestError("generate_batch takes a list of questions or of dicts")
        common.setdefault("received_at", time.perf_counter())  # every TTFT counts from this call
        items = []
        for i, item in enumerate(requests):
            args = dict(common)
            if isinstance(item, str):
                args["question"] = item
            elif isinstance(item, dict):
                args.update(item)
            else:
                raise InvalidRequestError(f"requests[{i}] must be a str or dict, got {type(item).__name__}")
            items.append(args)

        def build(args: dict) -> Request:
            return self.inputs.generation(args.pop("question", None), args.pop("chunks", None),
                                          args.pop("system", None), **args, streaming=False)

        # tokenizers release the GIL: a large batch's requests are built on a few threads (in order;
        # the first bad item raises, before anything is submitted)
        reqs = list(self._builders().map(build, items)) if len(items) >= 8 else [build(a) for a in items]
        for r in reqs:
            self.engine.submit(r)
        return [self._wait(r) for r in reqs]

    def _builders(self) -> ThreadPoolExecutor:
        """The threads that build a batch's requests (made on first use)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                            thread_name_prefix="lazyllm-inputs")
        return self._pool

    def score(self, question: str, chunks: Sequence[str | Chunk] | None = None, system: str | None = None, *,
              continuation: Sequence[int] | str, return_logits: bool = False) -> ScoreOutput:
        """Teacher-forced log-probabilities of ``continuation`` (token ids, or a string to
        tokenize) after the request's prompt, under the current reuse and chunk-context
        settings: for evaluation and reranking.

        Returns a ``ScoreOutput``: ``logprobs`` (one per continuation token), ``token_ids``,
        and with ``return_logits=True`` the full float32 ``logits`` of shape
        ``(len(continuation), vocab)``.
        """
        req = self.inputs.scoring(question, chunks, system, continuation, return_logits)
        self.engine.submit(req)
        return self._wait(req)

    def warm(self, chunks: Sequence[str | Chunk], system: str | None = None, *, batch_size: int = 16,
             progress: bool | None = None) -> dict:
        """Precompute and cache the KV of ``chunks`` (and of the system prefix) ahead of
        queries. Returns counts of chunk tokens computed and already cached. A no-op, with a
        warning, in the full-attention modes (``prefix``, ``none``), which cache no chunks."""
        if isinstance(chunks, (str, Chunk)):
            chunks = [chunks]
        chunks = [as_chunk(c, i) for i, c in enumerate(chunks)]
        if not self.engine.planner.caches_chunks:
            for i, c in enumerate(chunks):  # bad input is refused in every mode, not only where it would run
                check_text(c.text, f"chunks[{i}].text")
            return warm_skipped(self.reuse, self.quality, len(chunks))
        from tqdm.auto import tqdm

        show = progress if progress is not None else len(chunks) > batch_size
        computed = cached = 0
        with tqdm(total=len(chunks), desc="warming chunks", unit="chunk", disable=not show) as bar:
            for i in range(0, len(chunks), batch_size):
                part = chunks[i:i + batch_size]
                req = self.inputs.warming(part, system)
                self.engine.submit(req)
                self._wait(req)
                chunk_tokens = sum(len(s.ids) for s in req.segments if s.kind == "chunk")
                cached += req.plan.cached_chunk_tokens
                computed += chunk_tokens - req.plan.cached_chunk_tokens
                bar.update(len(part))
        return {"chunks": len(chunks), "computed_tokens": computed, "cached_tokens": cached}

    def warmup(self, progress: bool | None = None) -> dict:
        """Launch every kernel specialization and capture the CUDA graphs this engine uses
        before the first request (``lazyllm.engine.warmup.driver``; skipped on CPU). Runs once
        (``LazyLLM(warmup=True)`` calls it); returns its report: ``seconds``, ``kernels_compiled``,
        ``decode_graphs``, ``prefill_graphs``, ``capture_s``, ``requests``, ``skipped``."""
        return self._readiness.warm(self.engine, self.inputs.synthetic,
                                    self.config.progress if progress is None else progress)

    @property
    def ready(self) -> bool:
        """Warmed up (or made with ``warmup=False``): no request waits for a compile."""
        return self._readiness.ready

    def cache_stats(self) -> dict:
        """Hits, misses, hit rate, reused tokens, resident bytes, evictions and pool use, and
        ``kernels_compiled_after_ready``: Triton kernels compiled while requests waited."""
        s = self.store.stats()
        s["reuse"] = self.reuse
        s["chunk_context"] = self.chunk_context
        s["kernels_compiled_after_ready"] = self._readiness.compiled_after_ready
        return s

    def resident_chunk_keys(self, limit: int | None = None) -> list[bytes]:
        """Cache keys of the chunks whose KV is resident now, most recently used first (at
        most ``limit``): what a replica reports to a router that routes by document. A
        chunk's key does not depend on its position, only on the model, the chunk context,
        the prefix when it matters and its tokens (``lazyllm.cache.store.chunk_key``)."""
        return self.store.keys("chunk", limit)

    def clear_cache(self) -> int:
        """Drop every cached chunk that no running request uses; returns how many."""
        return self.engine.clear_cache()

    def count_tokens(self, text: str) -> int:
        return len(self.prompts.encode(text))

    def close(self) -> None:
        """Stop the engine thread (and the tensor-parallel workers); pending requests fail
        with ``LazyLLMError``."""
        self.engine.close()
        heap.release(self.engine)  # the heap its warm-up froze goes back to the collector
        self._readiness.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        if self._tp is not None:
            self._tp.close()

    def __repr__(self) -> str:
        return (f"LazyLLM(model={self.model_name!r}, device={self.device}, dtype={self.dtype}, "
                f"reuse={self.reuse!r}, chunk_context={self.chunk_context!r})")


LazyLLM.__doc__ += options_docstring()
LazyLLM.__init__.__signature__ = _signature()
# ``llm.<option>`` for the options declared ``attr``: the running configuration's value
for _f in dataclasses.fields(EngineConfig):
    if _f.metadata.get("attr"):
        setattr(LazyLLM, _f.name, _from_config(_f.name))

__all__ = ["LazyLLM"]
