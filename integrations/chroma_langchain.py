"""A LangChain retriever over a chromadb collection (deprecated; needs langchain-core)."""
# ruff: noqa: E402  (the extra is checked before its modules are imported)
from __future__ import annotations

from lazyllm.extras import require

require("langchain", "langchain_core")

import warnings
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForRetrieverRun, CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever


class ChromaRetriever(BaseRetriever):
    """Deprecated: use ``langchain_chroma.Chroma(client=..., collection_name=...,
    embedding_function=BundledMiniLMEmbeddings()).as_retriever(search_kwargs={"k": k})``,
    which returns the same documents (chroma id as ``id``, stored metadata).

    LangChain retriever over a chromadb collection: the ``k`` nearest documents to the
    query. The collection embeds the query with its own embedding function."""

    collection: Any
    k: int = 4
    where: dict | None = None
    where_document: dict | None = None

    def model_post_init(self, context: Any, /) -> None:
        warnings.warn("ChromaRetriever is deprecated: use langchain_chroma.Chroma(..., embedding_function="
                      "BundledMiniLMEmbeddings()).as_retriever()", DeprecationWarning, stacklevel=3)
        super().model_post_init(context)

    def _query(self, query: str) -> list[Document]:
        kw: dict[str, Any] = dict(query_texts=[query], n_results=self.k, include=["documents", "metadatas"])
        if self.where:
            kw["where"] = self.where
        if self.where_document:
            kw["where_document"] = self.where_document
        res = self.collection.query(**kw)
        return [Document(page_content=text, metadata=dict(meta or {}), id=i)
                for i, text, meta in zip(res["ids"][0], res["documents"][0], res["metadatas"][0])]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return self._query(query)

    async def _aget_relevant_documents(self, query: str, *,
                                       run_manager: AsyncCallbackManagerForRetrieverRun) -> list[Document]:
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(None, self._query, query)


__all__ = ["ChromaRetriever"]
