"""RAG with LlamaIndex, chromadb and lazyllm, offline, in a few seconds on a CPU.

The index lives in the standard ``llama-index-vector-stores-chroma`` store and embeds with
the bundled MiniLM (a LlamaIndex ``BaseEmbedding``, no network). ``ChunkSynthesizer`` hands
each retrieved node to the model as its own chunk (instead of the default ``compact`` mode,
which joins and re-splits them), so the second question, which retrieves some of the same
nodes in another order, reuses their KV: see the cached tokens and the TTFT. The third
question streams.

    python examples/llamaindex_rag.py [--db PATH] [--max-new-tokens N] [--model PATH]
"""
from __future__ import annotations

import argparse
import tempfile

import chromadb
from chromadb.config import Settings
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.vector_stores.chroma import ChromaVectorStore

from lazyllm.integrations.llama_index import BundledMiniLMEmbedding, ChunkSynthesizer, LlamaIndexLLM

CORPUS = {
    "mercury": "Mercury is the smallest planet and the closest to the Sun. A year on Mercury lasts 88 days.",
    "venus": "Venus is the hottest planet: its thick carbon dioxide atmosphere traps heat at about 465 C.",
    "earth": "Earth is the only planet known to support life. Liquid water covers about 71% of its surface.",
    "mars": "Mars is called the Red Planet because iron oxide dust covers its surface. It has two small moons.",
    "jupiter": "Jupiter is the largest planet. Its Great Red Spot is a storm bigger than Earth.",
    "saturn": "Saturn has the most spectacular rings, made of ice and rock, and more than 140 known moons.",
    "uranus": "Uranus rotates on its side, with an axial tilt of about 98 degrees.",
    "neptune": "Neptune is the farthest planet from the Sun and has the fastest winds in the solar system.",
}
QUESTIONS = ["Which planet is the hottest, and why?", "Which planets are the closest to and farthest from the Sun?"]
SYSTEM = "You answer questions about the solar system in one or two sentences, using the documents."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="chroma folder (default: a temporary one)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--model", default=None, help="model path or hub id (default: the embedded model)")
    ap.add_argument("--k", type=int, default=3, help="nodes retrieved per question")
    args = ap.parse_args()

    client = chromadb.PersistentClient(path=args.db or tempfile.mkdtemp(prefix="lazyllm-chroma-"),
                                       settings=Settings(anonymized_telemetry=False))
    # embedding_function=None: LlamaIndex passes its own vectors (chromadb's default function
    # would download a model)
    store = ChromaVectorStore(chroma_collection=client.get_or_create_collection("planets", embedding_function=None))
    docs = [Document(text=t, id_=k, metadata={"planet": k}) for k, t in CORPUS.items()]
    index = VectorStoreIndex.from_documents(docs, embed_model=BundledMiniLMEmbedding(),
                                            storage_context=StorageContext.from_defaults(vector_store=store))

    # The one line that differs from a HuggingFaceLLM setup:
    llm = LlamaIndexLLM(model_name=args.model, max_new_tokens=args.max_new_tokens, system_prompt=SYSTEM)
    engine = index.as_query_engine(llm=llm, response_synthesizer=ChunkSynthesizer(llm), similarity_top_k=args.k)

    try:
        for q in QUESTIONS:
            r = engine.query(q)
            u = r.metadata["lazyllm"]
            print(f"\nQ: {q}\n   retrieved: {[n.node.ref_doc_id for n in r.source_nodes]}\nA: {r.response.strip()}")
            print(f"   prompt {u['prompt_tokens']} tokens, cached {u['cached_tokens']}, "
                  f"TTFT {u['ttft_s'] * 1e3:.0f} ms, {u['completion_tokens']} new tokens ({u['finish_reason']})")

        streaming = index.as_query_engine(llm=llm, response_synthesizer=ChunkSynthesizer(llm, streaming=True),
                                          similarity_top_k=args.k)
        q = "Which planet has rings, and which one rotates on its side?"
        print(f"\nQ: {q}")
        r = streaming.query(q)
        print(f"   retrieved: {[n.node.ref_doc_id for n in r.source_nodes]}\nA: ", end="", flush=True)
        for delta in r.response_gen:
            print(delta, end="", flush=True)
        u = r.metadata["lazyllm"]
        print(f"\n   prompt {u['prompt_tokens']} tokens, cached {u['cached_tokens']}, TTFT {u['ttft_s'] * 1e3:.0f} ms")
        print(f"\ncache: {llm.lazyllm.cache_stats()}")
    finally:
        llm.lazyllm.close()


if __name__ == "__main__":
    main()
