"""Named fidelity presets for ``LazyLLM(quality=...)``: each a measured setting of the reuse
and recovery options (BENCHMARKS.md, "Quality presets"). A leaf module below the API:
``lazyllm.api`` applies the presets, and the fidelity report (``lazyllm.quality``, which
builds ``LazyLLM`` engines and so sits above the API) compares them.

* ``"isolated"``: chunk KV encoded alone and reused as is, nothing recomputed; a chunk's KV
  serves every system prompt, and the packet shipped for the model (if any) is applied.
* ``"fast"``: chunk KV reused as is, encoded after the shared system prefix; nothing
  recomputed. The cheapest TTFT after full reuse.
* ``"balanced"``: ``fast`` plus query-aware selective recompute: the first 4 tokens of each
  chunk and 14% of chunk tokens chosen two-stage (the question's attention, then key
  deviation) are recomputed with full context, for this request only (the shared cache
  stays reusable).
* ``"exact"``: full attention (identical-prefix reuse only, as vLLM): the model's own
  answer, at full prefill cost for the documents.
* ``"block-ft"``: for Block-Attention fine-tuned checkpoints (``ldsjmdy/Tulu3-Block-FT``,
  ``hxia7/Llama-3.2-1B-Block-FT``...): isolated chunks in the prompt layout they were
  trained with (``prompt_layout="block-ft"``, ``lazyllm.inputs.prompt_blockft``).

A preset is data only: the option values it sets, nothing the engine tests its name for.

``LazyLLM()`` with no preset runs ``DEFAULT_PRESET``'s (``"balanced"``) values
(``QUALITY_OPTIONS``): the cheapest setting whose answers stay inside full attention's own
order floor on the real-prose test split (docs/fidelity.md). Explicit options passed to
``LazyLLM`` override the preset's values (``lazyllm.config.EngineConfig.resolve``).
"""
from __future__ import annotations

PRESETS: dict[str, dict[str, object]] = {
    # chunks encoded alone (reusable under any system prompt), nothing recomputed, with the
    # packet shipped for the model where there is one
    "isolated": {"reuse": "lazy", "chunk_context": "isolated", "recompute_first_tokens": 0, "recompute_ratio": 0.0},
    "fast": {"reuse": "lazy", "chunk_context": "prefix", "recompute_first_tokens": 0, "recompute_ratio": 0.0},
    # first 4 tokens of each chunk + 14% chosen two-stage: at most 20% of 64-token chunks
    # (BENCHMARKS.md, "Quality presets"); the best fidelity within that budget on the default model
    "balanced": {"reuse": "lazy", "chunk_context": "prefix", "recompute_first_tokens": 4, "recompute_ratio": 0.14,
                 "recompute_selection": "two-stage"},
    "exact": {"reuse": "prefix", "chunk_context": "prefix", "recompute_first_tokens": 0, "recompute_ratio": 0.0},
    # for Block-Attention fine-tuned checkpoints: the isolated blocks they were trained on, in
    # their training prompt layout (lazyllm.inputs.prompt_blockft)
    "block-ft": {"reuse": "lazy", "chunk_context": "isolated", "recompute_first_tokens": 0, "recompute_ratio": 0.0,
                 "prompt_layout": "block-ft"},
}
# the preset whose values ``LazyLLM()`` runs when neither a preset nor the caller sets them: the
# cheapest setting inside full attention's own order floor on the real-prose test split
# (docs/fidelity.md)
DEFAULT_PRESET = "balanced"

# the other options a preset may set, at the values the default preset leaves them
_UNSET_BY_DEFAULT: dict[str, object] = {
    "recompute_selection_depth": 1.0,
    "context_temperature": 1.0,
    "context_lse_scale": 1.0,
    "escalate_below": 0.0,
    "escalate_tokens": 8,
    "prompt_layout": "chat",
}

# every option a preset may set, with its default: the default preset's values, each written once
QUALITY_OPTIONS: dict[str, object] = {**_UNSET_BY_DEFAULT, **PRESETS[DEFAULT_PRESET]}

__all__ = ["DEFAULT_PRESET", "PRESETS", "QUALITY_OPTIONS"]
