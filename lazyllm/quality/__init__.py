"""Fidelity report: how far each reuse setting's answers are from full attention's, on your
own questions and documents.

A chunk encoded alone never saw the other documents, so a request over cached chunk KV can
answer differently from the same model with full attention. ``compare`` measures by how
much, for each candidate setting, on the cases you give it::

    from lazyllm import LazyLLM
    from lazyllm.quality import compare

    report = compare(LazyLLM(), "cases.jsonl", target="top1>=0.97,kl<=0.01,same>=0.9")
    report.to_markdown(); report.plot(); report.recommend()

or from a shell: ``python -m lazyllm.quality cases.jsonl --target top1=0.97,kl=0.01``.

A case is a question, its retrieved documents, an optional system prompt and an optional
reference answer: a JSONL line ``{"question": ..., "documents": [...], "system": ...,
"reference": ...}``, a ``Case``, a dict, or questions plus a LangChain retriever
(``retriever.invoke(question)``) or LlamaIndex retriever / nodes (``NodeWithScore``,
``TextNode``) as the source of documents.

Per setting (and for full attention, the reference):

* ``top1``: fraction of answer positions where the setting's most likely token is full
  attention's, teacher-forced on full attention's greedy answer (``LazyLLM.score``);
* ``kl``: mean KL(full || setting) over those positions, nats per token;
* ``same_answer``: fraction of cases whose greedy answer starts with the same
  ``same_answer_tokens`` tokens as full attention's (read off the teacher-forced argmax:
  both see the same context up to the first difference);
* ``exact_match``: fraction of cases whose own greedy answer (or its first sentence) equals
  the reference answer (normalized: case, punctuation, articles, whitespace), and
  ``contains``: fraction whose answer contains the reference, when references are given;
* ``recomputed``: chunk tokens computed for the request over all chunk tokens, with every
  document cached beforehand (1.0 for full attention);
* ``ttft_ms``: median time to first token over the cases (warm chunk cache).

The order floor (``orders=4``, ``--orders``; ``lazyllm.quality.floor``): full attention
itself in other orders of each case's documents, on the same metrics; each setting's ratio to
it, its KL to the order-mean of full attention (``kl_mean``), and ``floor_choice()``, the
cheapest setting whose same-answer rate is at least the floor's and whose KL is at most twice
the floor's. A real-prose suite to run it on ships in ``benchmarks/data/prose/``.

The names below are imported on first use (``adapt`` and ``compare`` bring torch), so
``python -m lazyllm.quality`` checks its arguments before it pays for the engine.
"""
from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from lazyllm.extras import lazy_exports

if TYPE_CHECKING:
    from .adapt import AdaptResult, adapt
    from .cases import Case, cases_from_retriever, document_text, load_cases
    from .checks import DEFAULT_SETTINGS
    from .cli import main
    from .floor import FLOOR_NAME, other_orders
    from .metrics import (
        DEFAULT_TARGET,
        contains_answer,
        exact_match,
        kl_and_agreement,
        normalize_answer,
        parse_target,
    )
    from .report import REFERENCE_NAME, FidelityReport, compare

# each export's module
_EXPORTS = {
    "adapt": ".adapt", "AdaptResult": ".adapt",
    "Case": ".cases", "cases_from_retriever": ".cases", "document_text": ".cases", "load_cases": ".cases",
    "main": ".cli", "DEFAULT_SETTINGS": ".checks", "FLOOR_NAME": ".floor", "other_orders": ".floor",
    "DEFAULT_TARGET": ".metrics", "contains_answer": ".metrics", "exact_match": ".metrics",
    "kl_and_agreement": ".metrics", "normalize_answer": ".metrics", "parse_target": ".metrics",
    "REFERENCE_NAME": ".report", "FidelityReport": ".report", "compare": ".report",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)


class _Package(types.ModuleType):
    """This package, whose ``adapt`` is the function even once the submodule of that name
    is imported (which sets the package's attribute to the submodule, as an eager
    ``from .adapt import adapt`` here used to undo)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "adapt" and isinstance(value, types.ModuleType):
            value = value.adapt
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["adapt", "AdaptResult",
           "Case", "FidelityReport", "compare", "load_cases", "cases_from_retriever", "document_text",
           "kl_and_agreement", "normalize_answer", "exact_match", "contains_answer", "parse_target",
           "DEFAULT_TARGET", "DEFAULT_SETTINGS", "REFERENCE_NAME", "FLOOR_NAME", "other_orders", "main"]
