"""What each engine option does, in full: ``LazyLLM``'s docstring
(``lazyllm.config.options_docstring``) and docs/guide.md's option table
(``lazyllm.config.options_markdown``) are made from ``OPTION_DOCS``. Plain text, no imports."""
from __future__ import annotations

# a key names one field, or several that share a text
OPTION_DOCS: dict[str, str] = {
    "device": (
        '``"auto"`` (CUDA when present), ``"cpu"``, ``"cuda"``, ``"cuda:1"``...'
    ),
    "dtype": (
        "``None`` for float32 on CPU and bfloat16 on CUDA, or a torch dtype / name."
    ),
    "reuse": (
        '``"lazy"`` (zero-copy chunk reuse, positions applied in the attention kernel), ``"block"`` '
        '(Block-Attention baseline: per-request re-rotated copy), ``"prefix"`` (full attention, '
        'identical-prefix reuse, as vLLM), ``"none"``.'
    ),
    "chunk_context": (
        '``"isolated"`` (a chunk attends to itself only) or ``"prefix"`` (to the shared system prefix and '
        "itself)."
    ),
    "kv_cache_bytes": (
        "byte budget of the KV page pool (default: 1 GiB on CPU, 40% of free memory on CUDA)."
    ),
    "page_size": (
        "tokens per KV page (default: 64 with the Triton kernels on CUDA, where a key tile then lies in one "
        "page and the kernels rotate the query once per chunk instead of every key tile; 16 otherwise)."
    ),
    "attention_backend": (
        '``"auto"`` (Triton on CUDA, torch reference on CPU), ``"torch"`` or ``"triton"`` (on CPU, the '
        "kernels run in Triton's interpreter: for tests)."
    ),
    "max_batch_tokens": (
        "the prefill token budget of one engine step: requests are admitted together until their prompts "
        "reach it (a longer request is admitted alone)."
    ),
    "mixed_steps": (
        "schedule mixed steps: each engine step is one forward carrying the running requests' next tokens "
        "and the next prefill work (cold chunks, questions, recomputed tokens), up to ``step_token_budget`` "
        "tokens, so decoding never waits for a whole prefill round; a chunk or question longer than the "
        "budget is prefilled in pieces over several steps (the same KV as one pass). Steps with nothing to "
        "prefill are the ordinary decode steps (CUDA graphs); mixed steps run eagerly. Not with "
        "``tensor_parallel``. Off by default."
    ),
    "step_token_budget": (
        "with ``mixed_steps``, the tokens of one step: one per decoding request, the rest prefill work. A "
        "job that cannot be cut (recomputed tokens, scoring) runs whole when it is a step's only prefill work."
    ),
    "recompute_first_tokens": (
        "quality recovery: at query time, recompute the first this many tokens of every chunk with full "
        "context (their KV replaces the cached one for that request only; the cache stays reusable). 0 "
        "switches it off. Only meaningful with ``reuse`` ``lazy`` or ``block``."
    ),
    "recompute_ratio": (
        "quality recovery: also recompute, with full context, this fraction of the chunk tokens whose keys at "
        "an early layer deviate most from full attention (CacheBlend-style selection). 0 switches it off."
    ),
    "recompute_selection": (
        'how ``recompute_ratio`` picks its tokens: ``"deviation"`` (default, CacheBlend: layer-1 keys '
        'farthest from full attention\'s), ``"attention"`` (the tokens the question attends to most in a first '
        'pass over the cached KV; one extra forward of the question; more faithful than ``"deviation"`` on '
        'the default model) or ``"two-stage"`` (ProphetKV-style: that attention shortlists twice the budget, '
        "ranked then by attention times key deviation; the ``balanced`` preset's choice)."
    ),
    "recompute_selection_depth": (
        'the leading fraction of the layers the ``"attention"`` and ``"two-stage"`` first pass runs (1, '
        "default and ``balanced``'s: all; less is cheaper)."
    ),
    "escalate_below": (
        "adaptive recompute: a request whose answer is undecided at one of its first ``escalate_tokens`` "
        "tokens (the probability of the likeliest token minus the second's, after reuse, below this) goes on "
        "as full attention: at the first token it is prefilled again with every chunk token recomputed; at a "
        "later one, while decoding, that token is dropped and the request prefilled again with its tokens so "
        "far, every chunk token recomputed (the tokens already streamed stay). The margins cost one small "
        "reduction per token checked; an escalated request a second, full prefill. 0 (default): never; 0.01 "
        "escalates about 11% of real-prose requests on the default model, 0.03 about 29%. ``python "
        "benchmarks/quality.py prose --curve SETTING --escalate-tokens N`` prints what each threshold keeps "
        "and costs on real prose (docs/fidelity.md)."
    ),
    "escalate_tokens": (
        "how many of the answer's first tokens ``escalate_below`` checks (default 8; 1: the first only)."
    ),
    "context_temperature, context_lse_scale": (
        "APE-style calibration of how the question and the generated tokens read the retrieved documents, "
        "without recompute and without touching the cached KV: the documents' logits are divided by the "
        "temperature and their log-sum-exp multiplied by the scale (``reference.paged_attention_ref``'s "
        "``ctx_temperature`` / ``ctx_lse_scale``; fused into the Triton kernels). 1 and 1 (default): off. "
        "Decode steps with it run the per-request kernel (no shared-chunk decode); not with "
        "``tensor_parallel`` yet."
    ),
    "quality": (
        "a named fidelity preset (``lazyllm.presets.PRESETS``), measured on real prose against full "
        "attention's own order floor (docs/fidelity.md): ``\"isolated\"`` (chunks encoded alone, reusable "
        "under any system prompt, nothing recomputed, the model's shipped packet applied), ``\"fast\"`` "
        "(``chunk_context=\"prefix\"``, nothing recomputed), ``\"balanced\"`` (``fast`` plus the first 4 tokens of "
        "each chunk and 14% of chunk tokens, chosen by the question's attention and key deviation, recomputed "
        "with full context, per request), ``\"exact\"`` (``reuse=\"prefix\"``: full attention), or "
        "``\"block-ft\"`` for Block-Attention fine-tuned checkpoints (isolated chunks in the prompt layout "
        "they were trained with, ``lazyllm.inputs.prompt_blockft``). ``None`` (default): each option's own "
        "default, which are ``\"balanced\"``'s values (the cheapest setting inside the order floor). Options "
        "passed explicitly (``reuse``, ``chunk_context``, ``recompute_*``) override the preset's. "
        "``lazyllm.quality.compare`` measures them on your own data."
    ),
    "kv_disk_dir, kv_disk_bytes": (
        "an optional persistent tier for chunk KV (safetensors files, validated against the model "
        "fingerprint, settings and a checksum; atomic writes; LRU size cap): chunks computed once survive "
        "restarts. Written in the background; ``close()`` waits for pending writes."
    ),
    "trust_remote_code": (
        "passed to transformers; off unless you ask."
    ),
    "progress": (
        "show progress bars while the model downloads and loads, and during the warm-up."
    ),
    "batch_invariant": (
        "compute every token exactly as it would be computed alone: projections in fixed blocks of 128 rows "
        "and one attention launch configuration for prefill and decode (no split-K). In bfloat16/float16, "
        "GEMM libraries otherwise pick kernels by batch size, so a greedy answer can change in rare near-ties "
        "depending on what else runs in the same step. Costs speed (decode at batch 1 and long prefills are "
        "slower); off by default. float32 answers were batch-independent in our tests without it."
    ),
    "cuda_graphs": (
        "replay decode steps and short prefills (questions, recompute passes) from CUDA graphs captured per "
        "batch and width bucket (CUDA only; the torch reference backend never captures). ``False`` runs every "
        "step eagerly: for debugging and for comparing against the graphs; token for token the same answers."
    ),
    "overlap_decode": (
        "launch decode step ``n + 1`` (its tokens fed from step ``n``'s picks on the device) before the host "
        "reads step ``n``, so the GPU never waits for the host's per-step work. Greedy, sampled and "
        "constrained batches; token for token the same as stepping one at a time. ``None`` (default): on "
        "where decode runs from CUDA graphs."
    ),
    "kernel_options": (
        "a ``lazyllm.KernelOptions`` for the Triton launch choices (prefill kernel, key-tile loop, "
        "tiles, splits), for A/B measurements; ``None``: the measured defaults."
    ),
    "tensor_parallel": (
        "shard the model over this many processes, one per GPU (torch.distributed: NCCL on CUDA, gloo on "
        "CPU): attention and KV heads, the MLP and the LM head's vocabulary split across ranks, an all-reduce "
        "after the output and down projections. This process is rank 0 and runs the engine; the library "
        "starts and stops the others (``close()``). Must divide the model's attention heads, KV heads and MLP "
        "size, and on CUDA be at most the GPUs present. A checkpoint is loaded on the CPU by every rank, "
        "which keeps only its shard on its GPU; ``kv_cache_bytes`` is per rank. Not yet with it: CUDA graphs "
        "and the fused kernels (the forward runs eagerly), ``recompute_ratio`` and ``kv_disk_dir``. The "
        "workers are spawned and re-import the main module: guard a script's work with ``if __name__ == "
        '"__main__":``. Default 1 (one process). NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, '
        "``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``)."
    ),
    "warmup": (
        "before the first request, launch every kernel specialization and capture the CUDA graphs this engine "
        "uses for its model and pool (``warmup()``, with a progress bar; CUDA only: on CPU nothing compiles "
        "and it is skipped). ``False``: return at once, and the first requests wait for the compiles "
        '(``cache_stats()["kernels_compiled_after_ready"]``).'
    ),
    "packets": (
        "learned chunk packets (``lazyllm.model.packets``): a packet file trained for this model (``lazyllm "
        "adapt``) or a ``Packets``; its embeddings are placed around every chunk when the chunk's KV is "
        "computed and cached with it (each chunk gets ``k_header + k_trailer`` more tokens), which brings "
        'reused chunks closer to full attention without recomputing anything per request. ``"auto"`` '
        "(default): the packet shipped for this model and chunk context when there is one (the default "
        "model's), in the modes that cache chunks; ``None``: none. A packet of another model raises "
        '``InvalidRequestError``; so does one with ``reuse`` ``"prefix"``/``"none"`` (full attention has no '
        'chunks to carry it), ``quality="block-ft"`` or ``tensor_parallel``. The packet\'s tokens appear in '
        "``prompt_segments`` as virtual ids at and past the embedding table's size (not text). A bridge "
        "packet (``Packets(bridge=True)``) recomputes its trailer per request over the earlier chunks."
    ),
    "max_string_length": (
        "under a JSON ``response_format`` or tools, the longest string (characters) the model may write "
        "where the schema sets no ``maxLength``, so a weak model closes its strings; the schema's "
        "``maxLength`` wins. ``None``: unbounded. Default 256."
    ),
    "max_array_length": (
        "under a JSON ``response_format`` or tools, the most items an array may hold where the schema "
        "sets no ``maxItems`` (its ``minItems`` is kept), so a weak model that repeats an item stops; the "
        "schema's ``maxItems`` wins. ``None``: unbounded. Default 32."
    ),
    "max_json_depth": (
        "under a JSON ``response_format`` or tools, how deep (arrays and objects inside each other, the "
        "answer's top level counted) a value may nest where the schema leaves it free: "
        '``{"type": "json_object"}``, a schema ``{}``, the values of an object\'s other keys, an array '
        "without ``items``. The schema's own structure is kept as written. ``None``: unbounded. Default 8."
    ),
}
