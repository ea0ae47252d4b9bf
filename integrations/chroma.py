"""chromadb glue: an offline embedding function and ingestion with KV warm-up.

Retrieval goes through each framework's standard chroma package, with the bundled MiniLM
in the interface that framework expects (no network: chromadb's own default embedding
function downloads a model)::

    # LangChain (langchain-chroma)
    from langchain_chroma import Chroma
    from lazyllm.integrations.langchain import BundledMiniLMEmbeddings
    store = Chroma.from_texts(texts, embedding=BundledMiniLMEmbeddings(), ids=ids, client=client)
    retriever = store.as_retriever(search_kwargs={"k": 4})

    # LlamaIndex (llama-index-vector-stores-chroma)
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.vector_stores.chroma import ChromaVectorStore
    from lazyllm.integrations.llama_index import BundledMiniLMEmbedding
    store = ChromaVectorStore(chroma_collection=client.get_or_create_collection("docs"))
    index = VectorStoreIndex.from_documents(docs, embed_model=BundledMiniLMEmbedding(),
                                            storage_context=StorageContext.from_defaults(vector_store=store))

    # chromadb itself
    from lazyllm.integrations.chroma import BundledMiniLM, ingest
    col = client.get_or_create_collection("docs", embedding_function=BundledMiniLM())
    ingest(col, ["Paris is the capital of France.", ...], llm=llm)   # embeds and warms

Make clients with ``Settings(anonymized_telemetry=False)`` to keep chromadb from
reporting usage.

``BundledMiniLM`` is registered with chromadb's embedding-function registry, so once this
module is imported a persistent collection reopens with
``client.get_collection("docs")``, no embedding function passed, and no network. The
three embedding adapters return the same vectors, so one collection serves all of them.

``ingest(store, documents, llm=...)`` adds documents to a chroma collection or to a
LangChain ``Chroma`` vector store and precomputes their KV. Ingested document text is
stored as is and handed to the engine as is (chunk text = the stored document), so the
KV that ``ingest`` precomputes is exactly what later queries reuse, in either framework.
``as_llama_index(col)`` is a ``VectorStoreIndex`` over an existing collection.
(``ChromaRetriever`` is deprecated: use ``Chroma(...).as_retriever()``.)
"""
# ruff: noqa: E402  (the extra is checked before its modules are imported)
from __future__ import annotations

from lazyllm.extras import require

require("chroma", "chromadb")

import hashlib
from collections.abc import Sequence
from typing import Any

from chromadb.api.types import Documents, EmbeddingFunction, Embeddings, Space
from chromadb.utils.embedding_functions import register_embedding_function

from lazyllm import Chunk, InvalidRequestError

from ._common import resolve_lazyllm
from .minilm import MODEL_NAME, check_batch_size, embed


@register_embedding_function
class BundledMiniLM(EmbeddingFunction[Documents]):
    """chromadb embedding function backed by the bundled all-MiniLM-L6-v2 (384-d,
    unit-length vectors), computed in process with transformers. Offline, no arguments
    needed to rebuild it from a collection's stored configuration."""

    def __init__(self, batch_size: int = 32):
        self.batch_size = check_batch_size(batch_size)

    def __call__(self, input: Documents) -> Embeddings:
        return list(embed(input, batch_size=self.batch_size))

    @staticmethod
    def name() -> str:
        return "lazyllm_bundled_minilm"

    def default_space(self) -> Space:
        return "cosine"

    def supported_spaces(self) -> list[Space]:
        return ["cosine", "l2", "ip"]  # vectors are unit length: all three rank alike

    def get_config(self) -> dict[str, Any]:
        return {"model": MODEL_NAME, "batch_size": self.batch_size}

    @staticmethod
    def build_from_config(config: dict[str, Any]) -> BundledMiniLM:
        model = config.get("model", MODEL_NAME)
        if model != MODEL_NAME:
            raise InvalidRequestError(f"BundledMiniLM carries {MODEL_NAME}, not {model!r}")
        return BundledMiniLM(batch_size=int(config.get("batch_size", 32)))

    @staticmethod
    def validate_config(config: dict[str, Any]) -> None:
        if config.get("model", MODEL_NAME) != MODEL_NAME:
            raise InvalidRequestError(f"BundledMiniLM carries {MODEL_NAME}, not {config.get('model')!r}")


def doc_id(text: str) -> str:
    """Stable id of a document text, so that ingesting the same text twice is a no-op."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def _as_records(documents, ids, metadatas):
    """Texts, ids and metadata from strings, LangChain ``Document``s or LlamaIndex nodes."""
    texts, out_ids, metas = [], [], []
    for i, d in enumerate(documents):
        if isinstance(d, str):
            text, did, meta = d, None, None
        elif hasattr(d, "page_content"):  # LangChain Document
            text, did, meta = d.page_content, getattr(d, "id", None), dict(d.metadata or {})
        elif hasattr(d, "get_content") and hasattr(d, "node_id"):  # LlamaIndex node
            text, did, meta = d.get_content(), d.node_id, dict(d.metadata or {})
        else:
            raise InvalidRequestError(
                f"documents[{i}] must be a str, a LangChain Document or a LlamaIndex node, "
                f"got {type(d).__name__}")
        if not isinstance(text, str) or not text.strip():
            raise InvalidRequestError(f"documents[{i}] is empty")
        texts.append(text)
        out_ids.append(did)
        metas.append(meta)
    if ids is not None:
        if len(ids) != len(texts):
            raise InvalidRequestError(f"{len(ids)} ids for {len(texts)} documents")
        out_ids = [str(x) for x in ids]
    out_ids = [x if x is not None else doc_id(t) for x, t in zip(out_ids, texts)]
    if metadatas is not None:
        if len(metadatas) != len(texts):
            raise InvalidRequestError(f"{len(metadatas)} metadatas for {len(texts)} documents")
        metas = [dict(m) if m else None for m in metadatas]
    return texts, out_ids, metas


def ingest(collection, documents: Sequence[Any], ids: Sequence[str] | None = None,
           metadatas: Sequence[dict] | None = None, llm: Any = None, system: str | None = None,
           *, batch_size: int = 256, progress: bool | None = None) -> dict:
    """Add ``documents`` to a chroma ``collection`` or a LangChain ``Chroma`` vector store
    (upsert: re-ingesting is idempotent) and, when ``llm`` is given, precompute their
    chunk KV so the first queries that retrieve them are already warm.

    ``documents`` are strings, LangChain ``Document``s or LlamaIndex nodes. ``ids``
    default to the documents' own ids, else a hash of the text. ``llm`` is a ``LazyLLM``
    or any of our adapters (``ChatLazyLLM``, ``LazyLLMText``, ``LlamaIndexLLM``);
    ``system`` is only needed with ``chunk_context="prefix"``, where chunk KV depends
    on the system prompt. Empty metadata is stored as none (chroma rejects ``{}``).

    Returns ``{"added": n, "ids": [...], "warm": <LazyLLM.warm result or None>}``.
    """
    texts, ids_, metas = _as_records(documents, ids, metadatas)
    if not texts:
        return {"added": 0, "ids": [], "warm": None}
    if len(set(ids_)) != len(ids_):
        raise InvalidRequestError("two documents have the same id")
    for i in range(0, len(texts), batch_size):
        sl = slice(i, i + batch_size)
        if hasattr(collection, "add_texts"):  # a LangChain vector store: it embeds, then upserts
            has_meta = any(m for m in metas[sl])
            collection.add_texts(texts[sl], metadatas=[m or {} for m in metas[sl]] if has_meta else None,
                                 ids=ids_[sl])
            continue
        kw: dict[str, Any] = dict(ids=ids_[sl], documents=texts[sl])
        if any(m for m in metas[sl]):
            kw["metadatas"] = [m or None for m in metas[sl]]
        collection.upsert(**kw)
    warm = None
    if llm is not None:
        engine = resolve_lazyllm(llm)
        chunks = [Chunk(t, id=d, metadata=m or {}) for t, d, m in zip(texts, ids_, metas)]
        warm = engine.warm(chunks, system=system, progress=progress)
    return {"added": len(texts), "ids": ids_, "warm": warm}


def as_llama_index(collection, embed_model: Any = None):
    """A LlamaIndex ``VectorStoreIndex`` over ``collection`` (queries embedded with the
    same bundled MiniLM as the collection's documents). Needs
    ``llama-index-vector-stores-chroma``."""
    from llama_index.core import VectorStoreIndex

    try:
        from llama_index.vector_stores.chroma import ChromaVectorStore
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("as_llama_index needs `pip install llama-index-vector-stores-chroma`") from e
    from .llama_index import BundledMiniLMEmbedding

    store = ChromaVectorStore(chroma_collection=collection)
    return VectorStoreIndex.from_vector_store(store, embed_model=embed_model or BundledMiniLMEmbedding())


def __getattr__(name: str):
    # The LangChain retriever needs langchain-core: re-exported here lazily, so that
    # importing this module never requires LangChain.
    if name == "ChromaRetriever":
        from .chroma_langchain import ChromaRetriever

        return ChromaRetriever
    raise AttributeError(name)


__all__ = ["BundledMiniLM", "ingest", "doc_id", "as_llama_index", "ChromaRetriever"]  # noqa: F822 (lazy)
