"""RAG with LangChain, chromadb and lazyllm, offline, in a few seconds on a CPU.

Retrieval is the standard ``langchain-chroma`` vector store, embedding with the bundled
MiniLM (a LangChain ``Embeddings``, no network). The retrieved documents reach the model
as separate chunks (LangChain ``text-plain`` content blocks), so the second question,
which retrieves some of the same documents in another order, reuses their KV: see
``cache_read`` and the TTFT.

    python examples/langchain_rag.py [--db PATH] [--max-new-tokens N] [--model PATH]
"""
from __future__ import annotations

import argparse
import tempfile

from chromadb.config import Settings
from langchain_chroma import Chroma
from langchain_core.runnables import RunnablePassthrough

from lazyllm.integrations.langchain import BundledMiniLMEmbeddings, ChatLazyLLM, chunk_prompt, to_chunks

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
    ap.add_argument("--k", type=int, default=3, help="documents retrieved per question")
    args = ap.parse_args()

    db = args.db or tempfile.mkdtemp(prefix="lazyllm-chroma-")
    store = Chroma.from_texts(list(CORPUS.values()), embedding=BundledMiniLMEmbeddings(), ids=list(CORPUS),
                              metadatas=[{"planet": k} for k in CORPUS], collection_name="planets",
                              persist_directory=db, client_settings=Settings(anonymized_telemetry=False))
    retriever = store.as_retriever(search_kwargs={"k": args.k})

    # The one line that differs from a ChatHuggingFace chain:
    llm = ChatLazyLLM.from_model_id(args.model, max_tokens=args.max_new_tokens)
    chain = {"documents": retriever | to_chunks, "question": RunnablePassthrough()} | chunk_prompt(SYSTEM) | llm

    try:
        for q in QUESTIONS:
            ids = [d.id for d in retriever.invoke(q)]
            msg = chain.invoke(q)
            u, meta = msg.usage_metadata, msg.response_metadata
            print(f"\nQ: {q}\n   retrieved: {ids}\nA: {msg.text.strip()}")
            print(f"   prompt {u['input_tokens']} tokens, cached {u['input_token_details']['cache_read']}, "
                  f"TTFT {meta['ttft_s'] * 1e3:.0f} ms, {u['output_tokens']} new tokens ({meta['finish_reason']})")
        print(f"\ncache: {llm.llm.cache_stats()}")
    finally:
        llm.llm.close()


if __name__ == "__main__":
    main()
