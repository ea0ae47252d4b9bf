"""The engine options of ``LazyLLM``, each declared once: a field of ``EngineOptions`` made by
``lazyllm.option_spec.opt`` with its type, default, bounds or choices, one-line help and full
doc. ``lazyllm.config.EngineConfig`` (this class with its validation, ``resolve`` and the
rules between options) is what the library passes around; ``LazyLLM``'s signature, docstring
and attributes, docs/guide.md's option table and the command line's flags are made from these
fields (``lazyllm.option_spec``). Adding an option is adding a field here.

An option a quality preset sets takes its default from ``lazyllm.presets.QUALITY_OPTIONS``
(preset data: the default preset's values, ``DEFAULT_PRESET``, and the rest each option's
neutral value; each value written once there).

Light to import (no torch: a device or dtype check imports it only for a string it cannot
read itself), so a command line checks its flags before it pays for torch and transformers.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .kernels.options import calibration_problem
from .option_spec import opt
from .presets import PRESETS, QUALITY_OPTIONS
from .reuse_modes import REUSE_MODES
from .selections import BUILTIN_SELECTIONS, selection_names

if TYPE_CHECKING:
    from .kernels.options import KernelOptions

CHUNK_CONTEXTS = ("isolated", "prefix")
PROMPT_LAYOUTS = ("chat", "block-ft")
BACKENDS = ("auto", "torch", "triton")
# dtype option names -> the torch dtype's name (``getattr(torch, ...)``)
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
# the device strings checked without torch; any other string is checked by ``torch.device``
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu|meta)(:\d+)?")
# a JSON string's length bound under constrained decoding, where the schema sets none
# (characters): long enough for names, sentences and short paragraphs, short enough that a
# model which never closes its string stops within a few hundred tokens
DEFAULT_MAX_STRING_LENGTH = 256
# an array's length bound where the schema sets no maxItems, and how deep a value the schema
# leaves free (json_object, {}, an object's other keys) may nest: a model that never closes an
# array, or keeps opening objects, stops there instead of running to the token limit
DEFAULT_MAX_ARRAY_LENGTH = 32
DEFAULT_MAX_JSON_DEPTH = 8


# -- the checks of the options whose type says too little ----------------------------------
def device_problems(name: str, device) -> list[str]:
    if device is None or device == "auto" or is_torch(device, "device"):
        return []
    if isinstance(device, str) and _DEVICE.fullmatch(device):
        return []
    import torch

    try:
        torch.device(device)
    except (RuntimeError, TypeError) as e:
        return [f"invalid device {device!r}: {e}"]
    return []


def is_torch(value, kind: str) -> bool:
    """Whether ``value`` is a ``torch.<kind>`` (no torch imported: it cannot be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, getattr(torch, kind))


def dtype_problems(name: str, dtype) -> list[str]:
    if dtype is None or dtype == "auto" or (isinstance(dtype, str) and dtype in DTYPES):
        return []
    if is_torch(dtype, "dtype"):
        ok = str(dtype).removeprefix("torch.") in DTYPES.values()
        return [] if ok else [f"unsupported dtype {dtype}"]
    return [f"unsupported dtype {dtype!r}; use float32, float16 or bfloat16"]


def _power_of_two(name: str, p) -> list[str]:
    ok = isinstance(p, int) and not isinstance(p, bool) and p >= 1 and not p & (p - 1)
    return [] if ok else [f"{name} must be a power of two, got {p!r}"]


def _selection(name: str, v) -> list[str]:
    # the built-in names are valid before the engine (which registers them) is imported
    names = tuple(dict.fromkeys((*BUILTIN_SELECTIONS, *selection_names())))
    return [] if v in names else [f"{name} must be one of {names}, got {v!r}"]


def _path(name: str, v) -> list[str]:
    return [] if isinstance(v, (str, os.PathLike)) else [f"{name} must be a path, got {type(v).__name__}"]


def _kernel_options(name: str, v) -> list[str]:
    options = sys.modules.get("lazyllm.kernels.options")
    if options is not None and isinstance(v, options.KernelOptions):
        return []
    return [f"{name} must be a lazyllm.KernelOptions, got {type(v).__name__}"]


def none_or_text(text: str) -> str | None:
    """A flag's text, ``"none"`` read as ``None``."""
    return None if text.lower() == "none" else text


def on_off(text: str) -> bool:
    """A flag's ``on`` / ``off``."""
    if text not in ("on", "off"):
        import argparse

        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


@dataclass(frozen=True)
class EngineOptions:
    """The engine options, declared (``lazyllm.config.EngineConfig`` validates them)."""

    device: str = opt(
        "auto",
        "'auto' (CUDA when present), 'cpu', 'cuda', 'cuda:1'...",
        doc=('``"auto"`` (CUDA when present), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...'),
        check=device_problems,
    )
    dtype: Any = opt(
        None,
        "None/'auto': float32 on CPU, bfloat16 on CUDA; or a dtype name",
        doc=("``None`` for float32 on CPU and bfloat16 on CUDA, or a torch dtype / name."),
        choices=(None, "auto", *DTYPES), check=dtype_problems,
    )
    reuse: str = opt(
        QUALITY_OPTIONS["reuse"],
        "how chunk KV is reused",
        doc=('``"lazy"`` (zero-copy chunk reuse, positions applied in the attention kernel), ``"block"`` '
             '(Block-Attention baseline: per-request re-rotated copy), ``"prefix"`` (full attention, '
             'identical-prefix reuse, as vLLM), ``"none"``.'),
        choices=REUSE_MODES, attr=True,
    )
    chunk_context: str = opt(
        QUALITY_OPTIONS["chunk_context"],
        "what a cached chunk attends to: itself, or the system prefix and itself",
        doc=('``"isolated"`` (a chunk attends to itself only) or ``"prefix"`` (to the shared system prefix and '
             "itself)."),
        choices=CHUNK_CONTEXTS, attr=True,
    )
    kv_cache_bytes: int | None = opt(
        None,
        "bytes of the KV page pool (default: 1 GiB on CPU, 40% of free GPU memory)",
        doc=("byte budget of the KV page pool (default: 1 GiB on CPU, 40% of free memory on CUDA)."),
        bounds="[1, inf)",
    )
    page_size: int | None = opt(
        None,
        "tokens per KV page, a power of two (default: 64 with Triton on CUDA, else 16)",
        doc=("tokens per KV page (default: 64 with the Triton kernels on CUDA, where a key tile then lies in one "
             "page and the kernels rotate the query once per chunk instead of every key tile; 16 otherwise)."),
        check=_power_of_two, attr=True,
    )
    attention_backend: str = opt(
        "auto",
        "attention kernels: 'auto' (Triton on CUDA, torch on CPU)",
        doc=('``"auto"`` (Triton on CUDA, torch reference on CPU), ``"torch"`` or ``"triton"`` (on CPU, the kernels '
             "run in Triton's interpreter: for tests)."),
        choices=BACKENDS, attr=True,
    )
    max_batch_tokens: int = opt(
        8192,
        "prefill tokens per forward",
        doc=("the prefill token budget of one engine step: requests are admitted together until their prompts reach "
             "it (a longer request is admitted alone)."),
        bounds="[1, inf)",
    )
    mixed_steps: bool = opt(
        False,
        "one forward per step carries the decode tokens and the next prefill work",
        doc=("schedule mixed steps: each engine step is one forward carrying the running requests' next tokens and "
             "the next prefill work (cold chunks, questions, recomputed tokens), up to ``step_token_budget`` "
             "tokens, so decoding never waits for a whole prefill round; a chunk or question longer than the budget "
             "is prefilled in pieces over several steps (the same KV as one pass). Steps with nothing to prefill "
             "are the ordinary decode steps (CUDA graphs); mixed steps run eagerly. Not with ``tensor_parallel``. "
             "Off by default."),
    )
    step_token_budget: int = opt(
        2048,
        "tokens per mixed step, decode rows included (mixed_steps)",
        doc=("with ``mixed_steps``, the tokens of one step: one per decoding request, the rest prefill work. A job "
             "that cannot be cut (recomputed tokens, scoring) runs whole when it is a step's only prefill work."),
        bounds="[1, inf)",
    )
    recompute_first_tokens: int = opt(
        QUALITY_OPTIONS["recompute_first_tokens"],
        "recompute this many first tokens of every chunk with full context",
        doc=("quality recovery: at query time, recompute the first this many tokens of every chunk with full "
             "context (their KV replaces the cached one for that request only; the cache stays reusable). 0 "
             "switches it off. Only meaningful with ``reuse`` ``lazy`` or ``block``."),
        bounds="[0, inf)", attr=True,
    )
    recompute_ratio: float = opt(
        QUALITY_OPTIONS["recompute_ratio"],
        "also recompute this fraction of chunk tokens with full context, in [0, 1]",
        doc=("quality recovery: also recompute, with full context, this fraction of the chunk tokens whose keys at "
             "an early layer deviate most from full attention (CacheBlend-style selection). 0 switches it off."),
        bounds="[0, 1]", attr=True,
    )
    recompute_selection: str = opt(
        QUALITY_OPTIONS["recompute_selection"],
        "how recompute_ratio picks its tokens",
        doc=('how ``recompute_ratio`` picks its tokens: ``"deviation"`` (default, CacheBlend: layer-1 keys farthest '
             'from full attention\'s), ``"attention"`` (the tokens the question attends to most in a first pass '
             'over the cached KV; one extra forward of the question; more faithful than ``"deviation"`` on the '
             'default model) or ``"two-stage"`` (ProphetKV-style: that attention shortlists twice the budget, '
             "ranked then by attention times key deviation; the ``balanced`` preset's choice)."),
        choices=BUILTIN_SELECTIONS, check=_selection, attr=True,
    )
    recompute_selection_depth: float = opt(
        QUALITY_OPTIONS["recompute_selection_depth"],
        "the leading fraction of the layers whose attention the 'attention' and 'two-stage' selections sum, in (0, "
        "1]",
        doc=('the leading fraction of the layers the ``"attention"`` and ``"two-stage"`` first pass runs (1, '
             "default and ``balanced``'s: all; less is cheaper)."),
        bounds="(0, 1]", attr=True,
    )
    context_temperature: float = opt(
        QUALITY_OPTIONS["context_temperature"],
        "divide the documents' attention logits by this (1: off)",
        doc=("APE-style calibration of how the question and the generated tokens read the retrieved documents, "
             "without recompute and without touching the cached KV: the documents' logits are divided by the "
             "temperature and their log-sum-exp multiplied by the scale (``reference.paged_attention_ref``'s "
             "``ctx_temperature`` / ``ctx_lse_scale``; fused into the Triton kernels). 1 and 1 (default): off. "
             "Decode steps with it run the per-request kernel (no shared-chunk decode); not with "
             "``tensor_parallel`` yet."),
        check=calibration_problem, attr=True,
    )
    context_lse_scale: float = opt(
        QUALITY_OPTIONS["context_lse_scale"],
        "scale the documents' attention log-sum-exp by this (1: off)",
        check=calibration_problem, attr=True, with_previous=True,
    )
    escalate_below: float = opt(
        QUALITY_OPTIONS["escalate_below"],
        "answer with full attention a request whose first answer token's top-2 probability margin after reuse is "
        "below this, in [0, 1] (0: never)",
        doc=("adaptive recompute: a request whose answer is undecided at one of its first ``escalate_tokens`` "
             "tokens (the probability of the likeliest token minus the second's, after reuse, below this) goes on "
             "as full attention: at the first token it is prefilled again with every chunk token recomputed; at a "
             "later one, while decoding, that token is dropped and the request prefilled again with its tokens so "
             "far, every chunk token recomputed (the tokens already streamed stay). The margins cost one small "
             "reduction per token checked; an escalated request a second, full prefill. 0 (default): never; 0.01 "
             "escalates about 11% of real-prose requests on the default model, 0.03 about 29%. ``python "
             "benchmarks/quality.py prose --curve SETTING --escalate-tokens N`` prints what each threshold keeps "
             "and costs on real prose (docs/fidelity.md)."),
        bounds="[0, 1]", attr=True,
    )
    escalate_tokens: int = opt(
        QUALITY_OPTIONS["escalate_tokens"],
        "escalate_below checks this many first answer tokens, 1-64",
        doc=("how many of the answer's first tokens ``escalate_below`` checks (default 8; 1: the first only)."),
        bounds="[1, 64]", attr=True,
    )
    quality: str | None = opt(
        None,
        "a named fidelity preset; explicit options override it",
        doc=("a named fidelity preset (``lazyllm.presets.PRESETS``), measured on real prose against full "
             'attention\'s own order floor (docs/fidelity.md): ``"isolated"`` (chunks encoded alone, reusable under '
             'any system prompt, nothing recomputed, the model\'s shipped packet applied), ``"fast"`` '
             '(``chunk_context="prefix"``, nothing recomputed), ``"balanced"`` (``fast`` plus the first 4 tokens of '
             "each chunk and 14% of chunk tokens, chosen by the question's attention and key deviation, recomputed "
             'with full context, per request), ``"exact"`` (``reuse="prefix"``: full attention), or ``"block-ft"`` '
             "for Block-Attention fine-tuned checkpoints (isolated chunks in the prompt layout they were trained "
             "with, ``lazyllm.inputs.prompt_blockft``). ``None`` (default): each option's own default, which are "
             '``"balanced"``\'s values (the cheapest setting inside the order floor). Options passed explicitly '
             "(``reuse``, ``chunk_context``, ``recompute_*``) override the preset's. ``lazyllm.quality.compare`` "
             "measures them on your own data."),
        choices=(None, *PRESETS), attr=True,
    )
    prompt_layout: str = opt(
        QUALITY_OPTIONS["prompt_layout"],
        "the prompt's layout: the model's chat template, or the Block-Attention training layout",
        doc=('``"chat"`` (default): the model\'s chat template; ``"block-ft"``: the prompt layout '
             "Block-Attention fine-tuned checkpoints were trained with (``lazyllm.inputs.prompt_blockft``; "
             'the ``"block-ft"`` preset sets it). Not with ``packets``.'),
        choices=PROMPT_LAYOUTS, attr=True,
    )
    kv_disk_dir: str | os.PathLike | None = opt(
        None,
        "folder of a persistent chunk KV tier",
        doc=("an optional persistent tier for chunk KV (safetensors files, validated against the model fingerprint, "
             "settings and a checksum; atomic writes; LRU size cap): chunks computed once survive restarts. Written "
             "in the background; ``close()`` waits for pending writes."),
        check=_path,
    )
    kv_disk_bytes: int = opt(
        16 << 30,
        "size cap of the persistent tier, bytes",
        bounds="[1, inf)", with_previous=True,
    )
    trust_remote_code: bool = opt(
        False,
        "let transformers run the checkpoint's own code",
        doc=("passed to transformers; off unless you ask."),
    )
    progress: bool = opt(
        True,
        "show loading progress",
        doc=("show progress bars while the model downloads and loads, and during the warm-up."),
    )
    batch_invariant: bool = opt(
        False,
        "compute every token as it would be computed alone (slower)",
        doc=("compute every token exactly as it would be computed alone: projections in fixed blocks of 128 rows "
             "and one attention launch configuration for prefill and decode (no split-K). In bfloat16/float16, GEMM "
             "libraries otherwise pick kernels by batch size, so a greedy answer can change in rare near-ties "
             "depending on what else runs in the same step. Costs speed (decode at batch 1 and long prefills are "
             "slower); off by default. float32 answers were batch-independent in our tests without it."),
        attr=True,
    )
    cuda_graphs: bool = opt(
        True,
        "replay decode steps and short prefills from CUDA graphs (CUDA only); False runs every step eagerly",
        doc=("replay decode steps and short prefills (questions, recompute passes) from CUDA graphs captured per "
             "batch and width bucket (CUDA only; the torch reference backend never captures). ``False`` runs every "
             "step eagerly: for debugging and for comparing against the graphs; token for token the same answers."),
    )
    overlap_decode: bool | None = opt(
        None,
        "launch decode step n+1 before reading step n (None: where decode runs from CUDA graphs)",
        doc=("launch decode step ``n + 1`` (its tokens fed from step ``n``'s picks on the device) before the host "
             "reads step ``n``, so the GPU never waits for the host's per-step work. Greedy, sampled and "
             "constrained batches; token for token the same as stepping one at a time. ``None`` (default): on where "
             "decode runs from CUDA graphs."),
        parse=on_off, metavar="{on,off}",
    )
    kernel_options: KernelOptions | None = opt(
        None,
        "lazyllm.KernelOptions for the Triton launches",
        doc=("a ``lazyllm.KernelOptions`` for the Triton launch choices (prefill kernel, key-tile loop, tiles, "
             "splits), for A/B measurements; ``None``: the measured defaults."),
        check=_kernel_options, flag=False,
    )
    tensor_parallel: int = opt(
        1,
        "shard the model over this many processes, one per GPU",
        doc=("shard the model over this many processes, one per GPU (torch.distributed: NCCL on CUDA, gloo on CPU): "
             "attention and KV heads, the MLP and the LM head's vocabulary split across ranks, an all-reduce after "
             "the output and down projections. This process is rank 0 and runs the engine; the library starts and "
             "stops the others (``close()``). Must divide the model's attention heads, KV heads and MLP size, and "
             "on CUDA be at most the GPUs present. A checkpoint is loaded on the CPU by every rank, which keeps "
             "only its shard on its GPU; ``kv_cache_bytes`` is per rank. Not yet with it: CUDA graphs and the fused "
             "kernels (the forward runs eagerly), ``recompute_ratio`` and ``kv_disk_dir``. The workers are spawned "
             'and re-import the main module: guard a script\'s work with ``if __name__ == "__main__":``. Default 1 '
             "(one process). NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, "
             "``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``)."),
        bounds="[1, inf)", attr=True,
    )
    warmup: bool = opt(
        True,
        "before the first request, launch every kernel specialization and capture the CUDA graphs a workload uses "
        "(CUDA; nothing to do on CPU)",
        doc=("before the first request, launch every kernel specialization and capture the CUDA graphs this engine "
             "uses for its model and pool (``warmup()``, with a progress bar; CUDA only: on CPU nothing compiles "
             "and it is skipped). ``False``: return at once, and the first requests wait for the compiles "
             '(``cache_stats()["kernels_compiled_after_ready"]``).'),
    )
    packets: Any = opt(
        "auto",
        "learned chunk packets: a packet file, a lazyllm Packets, 'auto' (the one shipped for the model, if any) "
        "or None",
        doc=("learned chunk packets (``lazyllm.model.packets``): a packet file trained for this model (``lazyllm "
             "adapt``) or a ``Packets``; its embeddings are placed around every chunk when the chunk's KV is "
             "computed and cached with it (each chunk gets ``k_header + k_trailer`` more tokens), which brings "
             'reused chunks closer to full attention without recomputing anything per request. ``"auto"`` '
             "(default): the packet shipped for this model and chunk context when there is one (the default "
             "model's), in the modes that cache chunks; ``None``: none. A packet of another model raises "
             '``InvalidRequestError``; so does one with ``reuse`` ``"prefix"``/``"none"`` (full attention has no '
             'chunks to carry it), ``quality="block-ft"`` or ``tensor_parallel``. The packet\'s tokens appear in '
             "``prompt_segments`` as virtual ids at and past the embedding table's size (not text). A bridge packet "
             "(``Packets(bridge=True)``) recomputes its trailer per request over the earlier chunks."),
        parse=none_or_text, metavar="{auto,none,PATH}",
    )
    max_string_length: int | None = opt(
        DEFAULT_MAX_STRING_LENGTH,
        "under a JSON response_format or tools, the longest string the model may write where the schema sets no "
        "maxLength (characters; None: unbounded)",
        doc=("under a JSON ``response_format`` or tools, the longest string (characters) the model may write where "
             "the schema sets no ``maxLength``, so a weak model closes its strings; the schema's ``maxLength`` "
             "wins. ``None``: unbounded. Default 256."),
        bounds="[1, inf)",
    )
    max_array_length: int | None = opt(
        DEFAULT_MAX_ARRAY_LENGTH,
        "under a JSON response_format or tools, the most items an array may hold where the schema sets no maxItems "
        "(None: unbounded)",
        doc=("under a JSON ``response_format`` or tools, the most items an array may hold where the schema sets no "
             "``maxItems`` (its ``minItems`` is kept), so a weak model that repeats an item stops; the schema's "
             "``maxItems`` wins. ``None``: unbounded. Default 32."),
        bounds="[1, inf)",
    )
    max_json_depth: int | None = opt(
        DEFAULT_MAX_JSON_DEPTH,
        "under a JSON response_format or tools, how deep (arrays and objects) a value the schema leaves free may "
        "nest (None: unbounded)",
        doc=("under a JSON ``response_format`` or tools, how deep (arrays and objects inside each other, the "
             'answer\'s top level counted) a value may nest where the schema leaves it free: ``{"type": '
             '"json_object"}``, a schema ``{}``, the values of an object\'s other keys, an array without ``items``. '
             "The schema's own structure is kept as written. ``None``: unbounded. Default 8."),
        bounds="[1, inf)",
    )


def option_help(name: str) -> str:
    """The one-line help of option ``name``: another command's flag for the same option (the
    ``--device`` of ``lazyllm adapt`` and ``lazyllm quality``) says what ``lazyllm serve``'s says."""
    return {f.name: f.metadata["help"] for f in dataclasses.fields(EngineOptions)}[name]


__all__ = ["EngineOptions", "option_help", "CHUNK_CONTEXTS", "PROMPT_LAYOUTS", "BACKENDS", "DTYPES",
           "DEFAULT_MAX_STRING_LENGTH", "DEFAULT_MAX_ARRAY_LENGTH", "DEFAULT_MAX_JSON_DEPTH",
           "device_problems", "dtype_problems"]
