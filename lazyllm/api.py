"""``LazyLLM``: the public entry point."""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import queue
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .cache.store import ChunkStore, PagePool
from .config import CHUNK_CACHING_MODES, EngineConfig, warm_skipped
from .config import resolve_device as _resolve_device
from .config import resolve_dtype as _resolve_dtype
from .engine.detokenizer import Detokenizer
from .engine.engine import Engine, check_fits
from .engine.prompt import PromptBuilder, Segment
from .engine.prompt import _check_text as check_text
from .engine.request import Request
from .engine.warmup import COMPILES, Readiness, default_triton_cache
from .errors import InvalidRequestError
from .model.attention import make_backend
from .model.llama import LlamaFamilyModel
from .model.loader import eos_token_ids, fingerprint, load_hf
from .model.packets import resolve_packets
from .stream import TextStream
from .types import Chunk, GenerationOutput, SamplingParams, ScoreOutput, as_chunk, as_chunks


def _from_config(name: str) -> property:
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}``")


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
    device : ``"auto"`` (CUDA when present), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...
    dtype : ``None`` for float32 on CPU and bfloat16 on CUDA, or a torch dtype / name.
    reuse : ``"lazy"`` (zero-copy chunk reuse, positions applied in the attention kernel),
        ``"block"`` (Block-Attention baseline: per-request re-rotated copy),
        ``"prefix"`` (full attention, identical-prefix reuse, as vLLM), ``"none"``.
    chunk_context : ``"isolated"`` (a chunk attends to itself only) or ``"prefix"`` (to
        the shared system prefix and itself).
    kv_cache_bytes : byte budget of the KV page pool (default: 1 GiB on CPU, 40% of free
        memory on CUDA).
    page_size : tokens per KV page (default: 64 with the Triton kernels on CUDA, where a key
        tile then lies in one page and the kernels rotate the query once per chunk instead
        of every key tile; 16 otherwise).
    attention_backend : ``"auto"`` (Triton on CUDA, torch reference on CPU), ``"torch"``
        or ``"triton"`` (on CPU, the kernels run in Triton's interpreter: for tests).
    recompute_first_tokens : quality recovery: at query time, recompute the first this
        many tokens of every chunk with full context (their KV replaces the cached one for
        that request only; the cache stays reusable). 0 switches it off. Only meaningful
        with ``reuse`` ``lazy`` or ``block``.
    recompute_ratio : quality recovery: also recompute, with full context, this fraction
        of the chunk tokens whose keys at an early layer deviate most from full attention
        (CacheBlend-style selection). 0 switches it off.
    recompute_selection : how ``recompute_ratio`` picks its tokens: ``"deviation"``
        (default, CacheBlend: layer-1 keys farthest from full attention's),
        ``"attention"`` (the tokens the question attends to most in a first pass over the cached KV;
        one extra forward of the question; more faithful than ``"deviation"`` on the default model) or
        ``"two-stage"`` (ProphetKV-style: that attention shortlists twice the budget, ranked
        then by attention times key deviation; the ``balanced`` preset's choice).
    recompute_selection_depth : the leading fraction of the layers the ``"attention"`` and
        ``"two-stage"`` first pass runs (1, default and ``balanced``'s: all; less is cheaper).
    context_temperature, context_lse_scale : APE-style calibration of how the question and
        the generated tokens read the retrieved documents, without recompute and without
        touching the cached KV: the documents' logits are divided by the temperature and
        their log-sum-exp multiplied by the scale (``reference.paged_attention_ref``'s
        ``ctx_temperature`` / ``ctx_lse_scale``; fused into the Triton kernels). 1 and 1
        (default): off. Decode steps with it run the per-request kernel (no shared-chunk
        decode); not with ``tensor_parallel`` yet.
    batch_invariant : compute every token exactly as it would be computed alone: projections
        in fixed blocks of 128 rows and one attention launch configuration for prefill and
        decode (no split-K). In bfloat16/float16, GEMM libraries otherwise pick kernels by batch
        size, so a greedy answer can change in rare near-ties depending on what else runs in the
        same step. Costs speed (decode at batch 1 and long prefills are slower); off by
        default. float32 answers were batch-independent in our tests without it.
    overlap_decode : launch decode step ``n + 1`` (its tokens fed from step ``n``'s picks on
        the device) before the host reads step ``n``, so the GPU never waits for the host's
        per-step work. Greedy, sampled and constrained batches; token for token the same as
        stepping one at a time. ``None`` (default): on where decode runs from CUDA graphs.
    kv_disk_dir, kv_disk_bytes : an optional persistent tier for chunk KV (safetensors
        files, validated against the model fingerprint, settings and a checksum; atomic
        writes; LRU size cap): chunks computed once survive restarts. Written in the
        background; ``close()`` waits for pending writes.
    kernel_options : a ``lazyllm.kernels.KernelOptions`` for the Triton launch choices (prefill
        kernel, key-tile loop, tiles, splits), for A/B measurements; ``None``: the measured defaults.
    quality : a named fidelity preset (``lazyllm.presets.PRESETS``), measured on
        the default model (README, "Answer fidelity"): ``"fast"`` (``chunk_context="prefix"``,
        nothing recomputed), ``"balanced"`` (``fast`` plus the first 4 tokens of each chunk
        and 14% of chunk tokens, chosen by the question's attention and key deviation,
        recomputed with full context, per request), ``"exact"`` (``reuse="prefix"``: full
        attention), or ``"block-ft"`` for Block-Attention fine-tuned checkpoints (isolated
        chunks in the prompt layout they were trained with, ``lazyllm.engine.prompt_blockft``).
        ``None`` (default): each option's own default (``reuse="lazy"``, ``chunk_context="isolated"``,
        no recovery). Options passed explicitly (``reuse``, ``chunk_context``, ``recompute_*``)
        override the preset's. ``lazyllm.quality.compare`` measures them on your own data.
    trust_remote_code : passed to transformers; off unless you ask.
    tensor_parallel : shard the model over this many processes, one per GPU (torch.distributed:
        NCCL on CUDA, gloo on CPU): attention and KV heads, the MLP and the LM head's
        vocabulary split across ranks, an all-reduce after the output and down projections.
        This process is rank 0 and runs the engine; the library starts and stops the others
        (``close()``). Must divide the model's attention heads, KV heads and MLP size, and on
        CUDA be at most the GPUs present. A checkpoint is loaded on the CPU by every rank, which
        keeps only its shard on its GPU; ``kv_cache_bytes`` is per rank. Not yet with it:
        CUDA graphs and the fused kernels (the forward runs eagerly), ``recompute_ratio``
        and ``kv_disk_dir``. The workers are spawned and re-import the main module: guard a
        script's work with ``if __name__ == "__main__":``. Default 1 (one process).
    warmup : before the first request, launch every kernel specialization and capture the CUDA
        graphs this engine uses for its model and pool (``warmup()``, with a progress bar; CUDA
        only: on CPU nothing compiles and it is skipped). ``False``: return at once, and the
        first requests wait for the compiles (``cache_stats()["kernels_compiled_after_ready"]``).
    packets : learned chunk packets (``lazyllm.model.packets``): a packet file trained for this
        model (``lazyllm adapt``) or a ``Packets``; its embeddings are placed around every chunk
        when the chunk's KV is computed and cached with it (each chunk gets ``k_header +
        k_trailer`` more tokens), which brings reused chunks closer to full attention without
        recomputing anything per request. ``"auto"`` (default): the packet shipped for this
        model and chunk context when there is one (the default model's), in the modes that
        cache chunks; ``None``: none. A packet of another model raises ``InvalidRequestError``;
        so does one with ``reuse`` ``"prefix"``/``"none"`` (full attention has no chunks to
        carry it), ``quality="block-ft"`` or ``tensor_parallel``. The packet's tokens appear in
        ``prompt_segments`` as virtual ids at and past the embedding table's size (not text).
    """

    def __init__(
        self,
        model_name_or_path: str | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        device: str = "auto",
        dtype: Any = None,
        reuse: str | None = None,
        chunk_context: str | None = None,
        kv_cache_bytes: int | None = None,
        page_size: int | None = None,
        attention_backend: str = "auto",
        max_batch_tokens: int = 8192,
        recompute_first_tokens: int | None = None,
        recompute_ratio: float | None = None,
        recompute_selection: str | None = None,
        recompute_selection_depth: float | None = None,
        context_temperature: float | None = None,
        context_lse_scale: float | None = None,
        quality: str | None = None,
        kv_disk_dir: str | os.PathLike | None = None,
        kv_disk_bytes: int = 16 << 30,
        trust_remote_code: bool = False,
        progress: bool = True,
        batch_invariant: bool = False,
        overlap_decode: bool | None = None,
        kernel_options: Any = None,
        tensor_parallel: int = 1,
        packets: Any = "auto",
        warmup: bool = True,
        max_string_length: int | None = 256):
        config = EngineConfig.resolve(
            quality, device=device, dtype=dtype, reuse=reuse, chunk_context=chunk_context,
            kv_cache_bytes=kv_cache_bytes, page_size=page_size, attention_backend=attention_backend,
            max_batch_tokens=max_batch_tokens, recompute_first_tokens=recompute_first_tokens,
            recompute_ratio=recompute_ratio, recompute_selection=recompute_selection,
            recompute_selection_depth=recompute_selection_depth,
            context_temperature=context_temperature, context_lse_scale=context_lse_scale, kv_disk_dir=kv_disk_dir,
            kv_disk_bytes=kv_disk_bytes, trust_remote_code=trust_remote_code, progress=progress,
            batch_invariant=batch_invariant, overlap_decode=overlap_decode, kernel_options=kernel_options,
            tensor_parallel=tensor_parallel, packets=packets, warmup=warmup, max_string_length=max_string_length)
        self._tp = None
        self._grammar_compiler = None
        self._load(config, model_name_or_path, model, tokenizer)
        # an engine thread still inside torch at interpreter shutdown can abort the
        # process: stop it first (weakly referenced, so the LazyLLM can still be freed)
        _LIVE_ENGINES.add(self.engine)
        self._readiness = Readiness()
        self._readiness.begin(self)  # the warm-up where config.warmup, else ready at once

    # the options as the running configuration holds them (``llm.config``)
    quality = _from_config("quality")
    reuse = _from_config("reuse")
    chunk_context = _from_config("chunk_context")
    recompute_first_tokens = _from_config("recompute_first_tokens")
    recompute_ratio = _from_config("recompute_ratio")
    recompute_selection = _from_config("recompute_selection")
    recompute_selection_depth = _from_config("recompute_selection_depth")
    context_temperature = _from_config("context_temperature")
    context_lse_scale = _from_config("context_lse_scale")
    attention_backend = _from_config("attention_backend")
    page_size = _from_config("page_size")
    batch_invariant = _from_config("batch_invariant")
    tensor_parallel = _from_config("tensor_parallel")

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
        page_size = config.page_size
        if page_size is None:
            page_size = 64 if self.device.type == "cuda" and backend.name == "triton" else 16
        self.hf_model, self.tokenizer = hf, tok
        runner = {}
        if config.tensor_parallel > 1:
            from .engine.tp_runner import TensorParallelRunner, start_group

            self._check_tensor_parallel(hf.config)
            # the workers load a checkpoint themselves; a model passed in travels to them
            # (CPU tensors through shared memory, CUDA tensors through CUDA IPC)
            source = hf if model is not None else ("load", model_name_or_path, config.trust_remote_code)
            self._tp, self.model = start_group(
                config.tensor_parallel, hf, source, backend, self.device, self.dtype, live=_LIVE_TP_GROUPS,
                attention_backend=config.attention_backend, batch_invariant=config.batch_invariant,
                kernel_options=config.kernel_options)
            runner = {"runner_cls": TensorParallelRunner}
        else:
            self.model = LlamaFamilyModel(hf, attention=backend, batch_invariant=config.batch_invariant)
        self.model_fingerprint = fingerprint(self.model)
        c = config  # "auto" picks the shipped packet only where chunks are cached for it
        auto = c.reuse in CHUNK_CACHING_MODES and c.quality != "block-ft" and c.tensor_parallel == 1
        self.packets = resolve_packets(c.packets, self.model, self.chunk_context, auto=auto)
        # cache keys and the disk tier separate packet versions: a packet changes every chunk's KV
        self.fingerprint = self.model_fingerprint + (f":packets:{self.packets.digest}" if self.packets else "")
        kv_cache_bytes = self._make_store(page_size, config.kv_cache_bytes)
        self.prompts = PromptBuilder(tok, self.packets.ids(self.model.embed_rows) if self.packets else None)
        if config.quality == "block-ft":  # the Block-Attention training layout
            from .engine.prompt_blockft import BlockFTPromptBuilder

            self.prompts = BlockFTPromptBuilder(tok)
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
        from .engine.tp_runner import check_group

        check_group(self.tensor_parallel, cfg, self.device)

    def _open_disk(self):
        from .cache.disk import DiskKVStore

        c = self.config
        return None if c.kv_disk_dir is None else DiskKVStore(
            c.kv_disk_dir, c.kv_disk_bytes, fingerprint=self.fingerprint,
            settings={"chunk_context": c.chunk_context, "dtype": str(self.dtype)})

    # -- requests ------------------------------------------------------------------
    def _request(self, question, chunks, system, *, max_new_tokens=64, temperature=0.0, top_p=1.0, top_k=0,
                 seed=None, stop=None, timeout=None, warm_only=False, response_format=None, tools=None,
                 tool_choice=None, messages=None, parallel_tool_calls=False) -> Request:
        chunks = as_chunks(chunks)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=seed, stop=() if stop is None else stop)
        if params.max_new_tokens > self.model.spec.max_context:
            raise InvalidRequestError(f"max_new_tokens={params.max_new_tokens} exceeds the model's context "
                                      f"({self.model.spec.max_context} tokens)")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise InvalidRequestError(f"timeout must be a positive number of seconds, got {timeout!r}")
        structured = self._structured(response_format, tools, tool_choice, parallel_tool_calls)
        if warm_only:
            segs = self.prompts.build("warm", chunks, system)[:-1]
            segs.append(Segment("suffix", []))
        elif messages is not None or (structured is not None and structured.tools):
            segs = self._conversation(question, chunks, system, messages, structured)
        else:
            instruction = structured.instruction if structured is not None else None
            if instruction:
                system = f"{system.strip()}\n\n{instruction}" if isinstance(system, str) and system.strip() \
                    else instruction
            segs = self.prompts.build(question, chunks, system)
        n = sum(len(s.ids) for s in segs)
        check_fits(n, params, self.model.spec.max_context)
        req = Request(segments=segs, params=params, events=queue.Queue(), warm_only=warm_only)
        if structured is not None and structured.grammar is not None:
            req.constraint = self._grammars.constraint(structured.grammar)
        req.structured = structured
        if timeout is not None:
            req.deadline = req.submit_time + timeout
        req.detok = Detokenizer(self.tokenizer, params.stop)
        return req

    @property
    def _grammars(self):
        """Grammars compiled for this model's tokenizer (built on first use)."""
        if self._grammar_compiler is None:
            from .structured import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model.spec.vocab_size, self.config)
        return self._grammar_compiler

    def _structured(self, response_format, tools, tool_choice, parallel_tool_calls):
        if response_format is None and tools is None and tool_choice is None:
            return None
        from .structured import prepare

        return prepare(self._grammars, response_format, tools, tool_choice, parallel_tool_calls)

    def _conversation(self, question, chunks, system, messages, structured) -> list[Segment]:
        from .structured import build_conversation

        msgs = list(messages) if messages is not None else []
        if messages is not None and not isinstance(messages, (list, tuple)):
            raise InvalidRequestError("messages must be a list of message dicts")
        if question is not None:
            check_text(question, "question")
            msgs.append({"role": "user", "content": question})
        return build_conversation(self.prompts, msgs, chunks, system, structured.tools if structured else [],
                                  structured.instruction if structured else None)

    @staticmethod
    def _wait(req: Request) -> GenerationOutput:
        while True:
            kind, val = req.events.get()
            if kind == "done":
                st = getattr(req, "structured", None)
                return st.finalize(val) if st is not None and isinstance(val, GenerationOutput) else val
            if kind == "error":
                raise val

    def generate(self, question: str, chunks: Sequence[str | Chunk] | None = None, system: str | None = None,
                 *, max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = None, stop: str | Sequence[str] | None = None,
                 timeout: float | None = None, response_format: Any = None, tools: Sequence[dict] | None = None,
                 tool_choice: str | dict | None = None, messages: Sequence[dict] | None = None,
                 parallel_tool_calls: bool = False) -> GenerationOutput:
        """Answer ``question`` over ``chunks`` (each a ``str`` or ``Chunk``).

        Returns a ``GenerationOutput`` with ``text``, ``token_ids``, ``prompt_segments``,
        ``usage`` (``prompt_tokens``, ``cached_tokens``, ``completion_tokens``) and
        ``ttft_s``. Raises ``InvalidRequestError`` for bad input, ``ContextLengthError``
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
          message may carry its own ``"chunks"``), so an agent's steps reuse their KV.

        When ``max_new_tokens`` ends the answer first, ``finish_reason`` is ``"length"``,
        ``parsed`` is None and ``text`` holds the partial output.
        """
        req = self._request(question, chunks, system, max_new_tokens=max_new_tokens, temperature=temperature,
                            top_p=top_p, top_k=top_k, seed=seed, stop=stop, timeout=timeout,
                            response_format=response_format, tools=tools, tool_choice=tool_choice, messages=messages,
                            parallel_tool_calls=parallel_tool_calls)
        req.streaming = False
        self.engine.submit(req)
        try:
            return self._wait(req)
        except BaseException:
            req.cancelled.set()
            raise

    __call__ = generate

    def stream(self, question: str, chunks=None, system=None, **kw) -> TextStream:
        """Like ``generate`` but yields text deltas as they are decoded; the returned
        ``TextStream`` also works with ``async for``, and has ``.output`` (the
        ``GenerationOutput``) once exhausted. Stopping the iteration (``break``,
        ``close()``) cancels the request and frees its pages."""
        return TextStream(self.engine, self._request(question, chunks, system, **kw))

    async def agenerate(self, question: str, chunks=None, system=None, **kw) -> GenerationOutput:
        """Async ``generate``: cancelling the task cancels the request."""
        req = self._request(question, chunks, system, **kw)
        req.streaming = False
        loop = asyncio.get_running_loop()
        self.engine.submit(req)
        try:
            return await loop.run_in_executor(None, self._wait, req)
        except asyncio.CancelledError:
            req.cancelled.set()
            raise

    def astream(self, question: str, chunks=None, system=None, **kw) -> TextStream:
        """Async ``stream``: ``async for delta in llm.astream(...)``."""
        return self.stream(question, chunks, system, **kw)

    def generate_batch(self, requests: Sequence[dict | str], **common) -> list[GenerationOutput]:
        """Run many requests together (batched prefill and decode). Each item is a
        question string or a dict of ``generate`` arguments; ``common`` fills the rest.
        Bad input in any item raises before anything runs."""
        if isinstance(requests, (str, dict)) or not isinstance(requests, Sequence):
            raise InvalidRequestError("generate_batch takes a list of questions or of dicts")
        reqs = []
        for i, item in enumerate(requests):
            args = dict(common)
            if isinstance(item, str):
                args["question"] = item
            elif isinstance(item, dict):
                args.update(item)
            else:
                raise InvalidRequestError(f"requests[{i}] must be a str or dict, got {type(item).__name__}")
            q = args.pop("question", None)
            ch = args.pop("chunks", None)
            sy = args.pop("system", None)
            reqs.append(self._request(q, ch, sy, **args))
        for r in reqs:
            r.streaming = False
            self.engine.submit(r)
        return [self._wait(r) for r in reqs]

    def score(self, question: str, chunks: Sequence[str | Chunk] | None = None, system: str | None = None, *,
              continuation: Sequence[int] | str, return_logits: bool = False) -> ScoreOutput:
        """Teacher-forced log-probabilities of ``continuation`` (token ids, or a string to
        tokenize) after the request's prompt, under the current reuse and chunk-context
        settings: for evaluation and reranking.

        Returns a ``ScoreOutput``: ``logprobs`` (one per continuation token), ``token_ids``,
        and with ``return_logits=True`` the full float32 ``logits`` of shape
        ``(len(continuation), vocab)``.
        """
        if isinstance(continuation, str):
            _ = check_text(continuation, "continuation")
            cont = self.prompts.encode(continuation)
        elif isinstance(continuation, Sequence) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in continuation):
            cont = list(continuation)
        else:
            raise InvalidRequestError("continuation must be a str or a list of token ids")
        vocab = self.model.spec.vocab_size
        if not cont or any(t < 0 or t >= vocab for t in cont):
            raise InvalidRequestError(f"continuation must be non-empty token ids in [0, {vocab})")
        req = self._request(question, chunks, system, max_new_tokens=1)
        n = sum(len(sg.ids) for sg in req.segments) + len(cont)
        check_fits(n, req.params, self.model.spec.max_context)
        req.orig_segments = list(req.segments)
        suffix = req.segments[-1]
        req.segments = req.segments[:-1] + [Segment("suffix", suffix.ids + cont[:-1])]
        req.score_ids, req.logit_rows, req.score_only = cont, len(cont), True
        req.return_logits = bool(return_logits)
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
            return warm_skipped(self.reuse, self.quality, len(chunks))
        from tqdm.auto import tqdm

        show = progress if progress is not None else len(chunks) > batch_size
        computed = cached = 0
        with tqdm(total=len(chunks), desc="warming chunks", unit="chunk", disable=not show) as bar:
            for i in range(0, len(chunks), batch_size):
                part = chunks[i:i + batch_size]
                req = self._request("warm", part, system, max_new_tokens=1, warm_only=True)
                self.engine.submit(req)
                self._wait(req)
                chunk_tokens = sum(len(s.ids) for s in req.segments if s.kind == "chunk")
                cached += req.plan.cached_chunk_tokens
                computed += chunk_tokens - req.plan.cached_chunk_tokens
                bar.update(len(part))
        return {"chunks": len(chunks), "computed_tokens": computed, "cached_tokens": cached}

    def warmup(self, progress: bool | None = None) -> dict:
        """Launch every kernel specialization and capture the CUDA graphs this engine uses
        before the first request (``lazyllm.engine.warmup``; skipped on CPU). Runs once
        (``LazyLLM(warmup=True)`` calls it); returns its report: ``seconds``, ``kernels_compiled``,
        ``decode_graphs``, ``prefill_graphs``, ``capture_s``, ``requests``, ``skipped``."""
        return self._readiness.warm(self, self.config.progress if progress is None else progress)

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
        self._readiness.close()
        if self._tp is not None:
            self._tp.close()

    def __repr__(self) -> str:
        return (f"LazyLLM(model={self.model_name!r}, device={self.device}, dtype={self.dtype}, "
                f"reuse={self.reuse!r}, chunk_context={self.chunk_context!r})")


__all__ = ["LazyLLM"]
