"""The bundled MiniLM embedding model as LangChain ``Embeddings`` (needs langchain-core)."""
# ruff: noqa: E402  (the extra is checked before its modules are imported)
from __future__ import annotations

from lazyllm.extras import require

require("langchain", "langchain_core")

from langchain_core.embeddings import Embeddings

from .minilm import check_batch_size, embed


class BundledMiniLMEmbeddings(Embeddings):
    """LangChain ``Embeddings`` backed by the bundled all-MiniLM-L6-v2 (384-d, unit-length
    vectors), offline: the same vectors as ``lazyllm.integrations.chroma.BundledMiniLM``
    and the LlamaIndex ``BundledMiniLMEmbedding``. For ``langchain_chroma.Chroma`` or any
    LangChain vector store::

        store = Chroma.from_texts(texts, embedding=BundledMiniLMEmbeddings(), client=client)
        retriever = store.as_retriever(search_kwargs={"k": 4})
    """

    def __init__(self, batch_size: int = 32):
        self.batch_size = check_batch_size(batch_size)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return embed(texts, batch_size=self.batch_size).tolist()

    def embed_query(self, text: str) -> list[float]:
        return embed([text])[0].tolist()


__all__ = ["BundledMiniLMEmbeddings"]
