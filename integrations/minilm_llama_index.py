"""The bundled MiniLM embedding model as a LlamaIndex ``BaseEmbedding`` (needs llama-index-core)."""
# ruff: noqa: E402  (the extra is checked before its modules are imported)
from __future__ import annotations

from lazyllm.extras import require

require("llama-index", "llama_index.core")

import asyncio

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding

from .minilm import DIM, MODEL_NAME, embed


class BundledMiniLMEmbedding(BaseEmbedding):
    """LlamaIndex embedding model: the bundled all-MiniLM-L6-v2 (384-d, unit-length
    vectors), offline: the same vectors as ``lazyllm.integrations.chroma.BundledMiniLM``
    and the LangChain ``BundledMiniLMEmbeddings``. For ``VectorStoreIndex`` over
    ``llama_index.vector_stores.chroma.ChromaVectorStore`` or any other store."""

    model_name: str = MODEL_NAME
    embed_batch_size: int = 32
    dimensions: int = DIM

    @classmethod
    def class_name(cls) -> str:
        return "LazyLLMBundledMiniLM"

    def _get_query_embedding(self, query: str) -> Embedding:
        return embed([query])[0].tolist()

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return await asyncio.get_running_loop().run_in_executor(None, self._get_query_embedding, query)

    def _get_text_embedding(self, text: str) -> Embedding:
        return embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return embed(texts, batch_size=self.embed_batch_size).tolist()


MiniLMEmbedding = BundledMiniLMEmbedding  # the earlier name


__all__ = ["BundledMiniLMEmbedding", "MiniLMEmbedding"]
