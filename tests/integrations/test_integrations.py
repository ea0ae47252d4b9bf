"""LangChain, LlamaIndex and chromadb integrations, end to end and offline: a real
persistent chroma collection embedded with the bundled MiniLM, read through each
framework's standard chroma package (``langchain-chroma``, ``llama-index-vector-stores-chroma``),
the embedded default model, and chunk reuse checked through each framework's own usage fields.

No timing is asserted (timings on shared CI machines are noise); the TTFT of cold and
warm calls is printed (``pytest -s``) for the reader.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import textwrap

import chromadb
import numpy as np
import pytest
from chromadb.config import Settings
from langchain_chroma import Chroma
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnablePassthrough
from llama_index.core import Document as LIDocument
from llama_index.core import VectorStoreIndex
from llama_index.core.base.llms.types import ChatMessage, DocumentBlock, TextBlock
from llama_index.core.base.response.schema import StreamingResponse
from llama_index.core.schema import MetadataMode, TextNode

from lazyllm import Chunk, InvalidRequestError, LazyLLM
from lazyllm.inputs.conversation import HISTORY_HEADER
from lazyllm.integrations.chroma import BundledMiniLM, ChromaRetriever, as_llama_index, ingest
from lazyllm.integrations.langchain import (
    BundledMiniLMEmbeddings,
    ChatLazyLLM,
    LazyLLMText,
    chunk_prompt,
    decode_prompt,
    documents_to_messages,
    encode_prompt,
    format_documents,
    messages_to_request,
    to_chunks,
)
from lazyllm.integrations.llama_index import (
    BundledMiniLMEmbedding,
    ChunkSynthesizer,
    LlamaIndexLLM,
    MiniLMEmbedding,
    chat_to_request,
)

CORPUS = {
    "paris": "Paris is the capital of France. The Eiffel Tower, finished in 1889, stands in Paris.",
    "louvre": "The Louvre in Paris is the world's most visited museum and holds the Mona Lisa.",
    "berlin": "Berlin is the capital of Germany. The Brandenburg Gate stands in the centre of Berlin.",
    "rome": "Rome is the capital of Italy. The Colosseum in Rome held gladiator fights.",
    "madrid": "Madrid is the capital of Spain. The Prado museum in Madrid holds works by Velazquez.",
    "lisbon": "Lisbon is the capital of Portugal and lies on the Atlantic coast.",
    "vienna": "Vienna is the capital of Austria and is famous for classical music and coffee houses.",
    "amsterdam": "Amsterdam is the capital of the Netherlands and is known for its canals.",
}
META = {k: {"city": k, "n": i} for i, k in enumerate(CORPUS)}
# Two questions whose top-3 documents overlap, in another order.
Q1 = "Which museum holds the Mona Lisa?"
Q2 = "Which famous museums are in Paris and Madrid?"
SYSTEM = "Answer in one short sentence, using the documents."
K = 3
NEW_TOKENS = 24
KV_BYTES = 64 << 20

pytestmark = pytest.mark.slow


# -- fixtures ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def db_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("chroma"))


def _client(path):
    return chromadb.PersistentClient(path=path, settings=Settings(anonymized_telemetry=False))


@pytest.fixture(scope="module")
def collection(db_path):
    col = _client(db_path).get_or_create_collection("city_docs", embedding_function=BundledMiniLM())
    out = ingest(col, list(CORPUS.values()), ids=list(CORPUS), metadatas=[META[k] for k in CORPUS])
    assert out["added"] == len(CORPUS) and out["warm"] is None
    return col


@pytest.fixture(scope="module")
def lc_store(collection, db_path):
    """langchain-chroma's vector store over the same collection, embedding queries with the
    LangChain adapter of the same model."""
    return Chroma(client=_client(db_path), collection_name=collection.name,
                  embedding_function=BundledMiniLMEmbeddings())


@pytest.fixture
def make_engine(default_llm_parts):
    """Fresh engines (empty chunk store) over the one loaded default model."""
    made = []

    def make(**kw):
        kw.setdefault("quality", "isolated")  # the configuration these tests were written for
        model, tok = default_llm_parts
        e = LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=KV_BYTES, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _chunk_tokens(engine: LazyLLM, text: str) -> int:
    """Tokens whose KV a chunk computes: its text's and, with a learned packet (the default
    model ships one), the packet's header and trailer."""
    p = engine.packets
    extra = p.k_header + p.k_trailer if p is not None else 0
    return len(engine.prompts.encode(engine.prompts.chunk_text(Chunk(text)))) + extra


def _ids(collection, q):
    return collection.query(query_texts=[q], n_results=K)["ids"][0]


def _overlap(collection):
    a, b = _ids(collection, Q1), _ids(collection, Q2)
    shared = [i for i in a if i in b]
    # the premise of the reuse tests: overlapping documents, retrieved in another order
    assert shared and [i for i in b if i in shared] != shared, (a, b)
    return a, b, shared


def _lc_chain(store, chat):
    retriever = store.as_retriever(search_kwargs={"k": K})
    return {"documents": retriever | to_chunks, "question": RunnablePassthrough()} | chunk_prompt(SYSTEM) | chat


def _li_engine(collection, llm, **kw):
    return as_llama_index(collection).as_query_engine(
        llm=llm, response_synthesizer=ChunkSynthesizer(llm, system=SYSTEM, **kw), similarity_top_k=K)


# -- chromadb and the embedding model ----------------------------------------------

def test_bundled_minilm_vectors(collection):
    ef = BundledMiniLM()
    v = np.asarray(ef(["The Eiffel Tower is in Paris.", "Gladiators fought in the Colosseum."]))
    assert v.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    # LlamaIndex's embedding class gives the same vectors
    li = np.asarray(BundledMiniLMEmbedding().get_text_embedding_batch(["The Eiffel Tower is in Paris."]))
    np.testing.assert_allclose(li[0], v[0], atol=1e-5)
    assert _ids(collection, "Where did gladiators fight?")[0] == "rome"
    assert BundledMiniLM.build_from_config(ef.get_config()).get_config() == ef.get_config()


TEXTS = ["The Eiffel Tower is in Paris.", "Gladiators fought in the Colosseum.", "Vienna has coffee houses."]


def test_langchain_embeddings_adapter():
    emb = BundledMiniLMEmbeddings()
    docs = emb.embed_documents(TEXTS)
    assert isinstance(docs, list) and all(isinstance(v, list) and isinstance(v[0], float) for v in docs)
    v = np.asarray(docs)
    assert v.shape == (len(TEXTS), 384)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert emb.embed_documents(TEXTS) == docs  # deterministic
    np.testing.assert_allclose(BundledMiniLMEmbeddings(batch_size=1).embed_documents(TEXTS), v, atol=1e-5)
    np.testing.assert_allclose(v, np.asarray(BundledMiniLM()(TEXTS)), atol=1e-6)  # chromadb's function
    q = emb.embed_query(TEXTS[1])
    assert len(q) == 384 and emb.embed_query(TEXTS[1]) == q
    np.testing.assert_allclose(q, BundledMiniLM()([TEXTS[1]])[0], atol=1e-6)
    assert asyncio.run(emb.aembed_query(TEXTS[1])) == q
    with pytest.raises(InvalidRequestError):
        BundledMiniLMEmbeddings(batch_size=0)


def test_llama_index_embedding_adapter():
    emb = BundledMiniLMEmbedding()
    assert MiniLMEmbedding is BundledMiniLMEmbedding  # the earlier name still works
    batch = emb.get_text_embedding_batch(TEXTS)
    v = np.asarray(batch)
    assert v.shape == (len(TEXTS), 384) and emb.dimensions == 384
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert emb.get_text_embedding_batch(TEXTS) == batch  # deterministic
    np.testing.assert_allclose(v, np.asarray(BundledMiniLM()(TEXTS)), atol=1e-6)  # chromadb's function
    q = emb.get_query_embedding(TEXTS[1])
    np.testing.assert_allclose(q, BundledMiniLM()([TEXTS[1]])[0], atol=1e-6)
    np.testing.assert_allclose(emb.get_text_embedding(TEXTS[0]), v[0], atol=1e-5)
    assert asyncio.run(emb.aget_query_embedding(TEXTS[1])) == q


def test_standard_retrievers_match_the_collection(collection, lc_store):
    """langchain-chroma's retriever and LlamaIndex's ChromaVectorStore return what a plain
    chroma query over the same collection returns (the three embedding adapters agree), and
    the deprecated ChromaRetriever still gives the same documents."""
    for q in (Q1, Q2, "Where did gladiators fight?"):
        ids = _ids(collection, q)
        docs = lc_store.as_retriever(search_kwargs={"k": K}).invoke(q)
        assert [d.id for d in docs] == ids
        assert [d.page_content for d in docs] == [CORPUS[i] for i in ids]
        assert [d.metadata for d in docs] == [META[i] for i in ids]
        nodes = as_llama_index(collection).as_retriever(similarity_top_k=K).retrieve(q)
        assert [n.node.node_id for n in nodes] == ids
        with pytest.warns(DeprecationWarning, match="langchain_chroma"):
            old = ChromaRetriever(collection=collection, k=K)
        assert [(d.id, d.page_content, d.metadata) for d in old.invoke(q)] == [
            (d.id, d.page_content, d.metadata) for d in docs]


def test_ingest_into_langchain_chroma_store(db_path, make_engine):
    engine = make_engine()
    store = Chroma(client=_client(db_path), collection_name="lc_ingest", embedding_function=BundledMiniLMEmbeddings())
    docs = [Document(page_content=CORPUS[k], metadata=META[k], id=k) for k in CORPUS]
    out = ingest(store, docs, llm=engine)
    assert out["ids"] == list(CORPUS) and out["added"] == len(CORPUS)
    assert out["warm"]["computed_tokens"] == sum(_chunk_tokens(engine, t) for t in CORPUS.values())
    again = ingest(store, docs, llm=engine)  # upsert: no duplicates, nothing recomputed
    assert again["warm"]["computed_tokens"] == 0
    got = store.get(include=["documents", "metadatas"])
    assert sorted(got["ids"]) == sorted(CORPUS)
    assert {i: (d, m) for i, d, m in zip(got["ids"], got["documents"], got["metadatas"])} == {
        k: (CORPUS[k], META[k]) for k in CORPUS}
    assert [d.id for d in store.similarity_search("Where did gladiators fight?", k=1)] == ["rome"]


def test_collection_reopens_without_embedding_function(collection, db_path):
    # same process, new client
    col = _client(db_path).get_collection("city_docs")
    assert col.configuration_json["embedding_function"]["name"] == BundledMiniLM.name()
    assert col.query(query_texts=["Where is the Brandenburg Gate?"], n_results=1)["ids"][0] == ["berlin"]
    # a new process that only imports the module, offline
    code = textwrap.dedent(f"""
        import json, chromadb
        import lazyllm.integrations.chroma  # registers BundledMiniLM with chromadb
        from chromadb.config import Settings
        col = chromadb.PersistentClient(path={db_path!r}, settings=Settings(anonymized_telemetry=False)
                                        ).get_collection("city_docs")
        res = col.query(query_texts=["Where is the Brandenburg Gate?"], n_results=1)
        print(json.dumps({{"ef": col.configuration_json["embedding_function"]["name"], "ids": res["ids"][0]}}))
    """)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"ef": BundledMiniLM.name(), "ids": ["berlin"]}


def test_ingest_is_idempotent_and_warms(collection, lc_store, make_engine):
    engine = make_engine()
    texts = list(CORPUS.values())
    out = ingest(collection, texts, ids=list(CORPUS), metadatas=[META[k] for k in CORPUS], llm=ChatLazyLLM(llm=engine))
    assert collection.count() == len(CORPUS)
    assert out["warm"]["computed_tokens"] == sum(_chunk_tokens(engine, t) for t in texts)
    again = ingest(collection, texts, ids=list(CORPUS), metadatas=[META[k] for k in CORPUS], llm=engine)
    assert again["warm"]["computed_tokens"] == 0 and again["warm"]["cached_tokens"] == out["warm"]["computed_tokens"]
    # a query after the warm-up reuses every chunk it retrieves
    msg = _lc_chain(lc_store, ChatLazyLLM(llm=engine, max_tokens=NEW_TOKENS)).invoke(Q1)
    chunk_tokens = sum(_chunk_tokens(engine, CORPUS[i]) for i in _ids(collection, Q1))
    assert msg.usage_metadata["input_token_details"]["cache_read"] >= chunk_tokens
    with pytest.raises(InvalidRequestError):
        ingest(collection, ["a", "b"], ids=["same", "same"])


# -- LangChain ---------------------------------------------------------------------

def test_langchain_chain_answers_and_reuses_chunks(collection, lc_store, make_engine):
    a, b, shared = _overlap(collection)
    engine = make_engine()
    chain = _lc_chain(lc_store, ChatLazyLLM(llm=engine, max_tokens=NEW_TOKENS))
    first = chain.invoke(Q1)
    second = chain.invoke(Q2)
    for msg, ids in ((first, a), (second, b)):
        assert isinstance(msg, AIMessage) and msg.text.strip()
        assert msg.response_metadata["chunk_ids"] == ids  # documents reached the engine as chunks
        u = msg.usage_metadata
        assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
        assert msg.response_metadata["finish_reason"] in ("stop", "length")
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0  # fresh engine: all cold
    reused = sum(_chunk_tokens(engine, CORPUS[i]) for i in shared)
    assert second.usage_metadata["input_token_details"]["cache_read"] >= reused > 0
    print(f"\nLangChain  cold TTFT {first.response_metadata['ttft_s'] * 1e3:7.1f} ms, "
          f"warm TTFT {second.response_metadata['ttft_s'] * 1e3:7.1f} ms "
          f"(cache_read {second.usage_metadata['input_token_details']['cache_read']} of "
          f"{second.usage_metadata['input_tokens']} prompt tokens)")
    print(f"  Q1: {first.text!r}\n  Q2: {second.text!r}")


def test_langchain_stream_callbacks_and_stop(collection, lc_store, make_engine):
    engine = make_engine()
    chat = ChatLazyLLM(llm=engine, max_tokens=NEW_TOKENS)
    chain = _lc_chain(lc_store, chat)
    seen = []

    class Tokens(BaseCallbackHandler):
        def on_llm_new_token(self, token, **kw):
            seen.append(token)

    parts = list(chain.stream(Q1, config={"callbacks": [Tokens()]}))
    full = parts[0]
    for p in parts[1:]:
        full = full + p
    assert len(parts) > 2 and parts[-1].chunk_position == "last"
    assert "".join(seen) == full.text and full.text.strip()
    assert full.usage_metadata["output_tokens"] > 0
    reference = chain.invoke(Q1)
    assert reference.text == full.text  # greedy: streaming changes nothing
    # streaming=True: invoke streams inside, callbacks see every token
    seen.clear()
    streamed = _lc_chain(lc_store, ChatLazyLLM(llm=engine, max_tokens=NEW_TOKENS, streaming=True)).invoke(
        Q1, config={"callbacks": [Tokens()]})
    assert streamed.text == reference.text == "".join(seen)
    assert streamed.usage_metadata == reference.usage_metadata
    # stop sequences cut the text before the stop string
    word = reference.text.split()[2]
    stopped = _lc_chain(lc_store, chat.bind(stop=[word])).invoke(Q1)
    assert word not in stopped.text and reference.text.startswith(stopped.text)
    assert stopped.response_metadata["finish_reason"] == "stop"


def test_langchain_async_and_batch(collection, lc_store, make_engine):
    engine = make_engine()
    chain = _lc_chain(lc_store, ChatLazyLLM(llm=engine, max_tokens=NEW_TOKENS))
    ref = [chain.invoke(q).text for q in (Q1, Q2)]
    assert [m.text for m in chain.batch([Q1, Q2])] == ref

    async def run():
        got = [m.text for m in await chain.abatch([Q1, Q2])]
        parts = [p async for p in chain.astream(Q2)]
        return got, "".join(p.text for p in parts), parts[-1].usage_metadata

    got, streamed, usage = asyncio.run(run())
    assert got == ref and streamed == ref[1]
    assert usage["input_token_details"]["cache_read"] > 0


def test_lazy_answers_do_not_depend_on_cache(collection, lc_store, make_engine):
    """Same query, same answer, on a fresh engine and on one whose chunk store already
    holds every document (computed in other requests, at other positions)."""
    fresh = make_engine()
    warmed = make_engine()
    ingest(collection, list(CORPUS.values()), ids=list(CORPUS), metadatas=[META[k] for k in CORPUS], llm=warmed)
    cold_chain = _lc_chain(lc_store, ChatLazyLLM(llm=fresh, max_tokens=NEW_TOKENS))
    warm_chain = _lc_chain(lc_store, ChatLazyLLM(llm=warmed, max_tokens=NEW_TOKENS))
    warm_chain.invoke(Q1)
    cold, warm = cold_chain.invoke(Q2), warm_chain.invoke(Q2)
    assert cold.usage_metadata["input_token_details"]["cache_read"] == 0
    assert warm.usage_metadata["input_token_details"]["cache_read"] > 0
    assert warm.text == cold.text
    # LlamaIndex, on the same two engines
    li_cold = _li_engine(collection, LlamaIndexLLM(llm=fresh, max_new_tokens=NEW_TOKENS)).query(Q1)
    li_warm = _li_engine(collection, LlamaIndexLLM(llm=warmed, max_new_tokens=NEW_TOKENS)).query(Q1)
    assert li_warm.response == li_cold.response
    assert li_warm.metadata["lazyllm"]["cached_tokens"] >= li_cold.metadata["lazyllm"]["cached_tokens"]


def test_lazyllm_text_keeps_documents(make_engine):
    engine = make_engine()
    docs = [Document(CORPUS[k], id=k, metadata=META[k]) for k in ("louvre", "madrid")]
    llm = LazyLLMText(llm=engine, max_tokens=NEW_TOKENS)
    chat = ChatLazyLLM(llm=engine, max_tokens=NEW_TOKENS)
    msgs = documents_to_messages(docs, Q1, system=SYSTEM)
    res = llm.generate_prompt([llm._convert_input(msgs)])
    info = res.generations[0][0].generation_info
    assert info["chunk_ids"] == ["louvre", "madrid"]  # LangChain's own to_string would drop them
    assert res.generations[0][0].text == chat.invoke(msgs).text  # same request as the chat model
    # string prompt with tagged documents (format_documents in place of format_docs)
    from langchain_core.prompts import PromptTemplate

    prompt = PromptTemplate.from_template("Context:\n{context}\n{question}")
    chain = {"context": lambda q: format_documents(docs), "question": RunnablePassthrough()} | prompt | llm
    assert chain.invoke(Q1).strip()
    assert "".join(llm.stream(msgs)) == res.generations[0][0].text
    assert asyncio.run(llm.ainvoke(msgs)) == res.generations[0][0].text


def test_from_model_id_is_a_drop_in():
    chat = ChatLazyLLM.from_model_id(model_id=None, task="text-generation", device=-1,
                                     pipeline_kwargs={"max_new_tokens": 8, "do_sample": False},
                                     kv_cache_bytes=KV_BYTES)
    try:
        assert chat.max_tokens == 8 and chat.temperature == 0.0 and chat.llm.device.type == "cpu"
        assert chat._identifying_params["model_name"] == chat.llm.model_name
        assert chat.invoke("Hello").usage_metadata["output_tokens"] <= 8
        with pytest.raises(InvalidRequestError):
            chat.invoke("Hello", model="some-other-model")
        with pytest.raises(InvalidRequestError):
            ChatLazyLLM.from_model_id(None, task="summarization")
        with pytest.raises(InvalidRequestError):
            ChatLazyLLM.from_model_id(None, pipeline_kwargs={"repetition_penalty": 1.1})
    finally:
        chat.llm.close()


@pytest.mark.parametrize("preset", ["fast", "balanced", "exact"])
def test_a_preset_given_to_an_adapter_runs_what_lazyllm_runs(preset, default_llm_parts):
    """Adapters pass on only the options their caller set: a ``quality`` preset in
    ``engine_kwargs`` gives the configuration ``LazyLLM(quality=...)`` gives, not the
    preset overridden by restated defaults."""
    model, tok = default_llm_parts
    parts = {"model": model, "tokenizer": tok}
    ref = LazyLLM(quality=preset, kv_cache_bytes=KV_BYTES, **parts)
    chat = ChatLazyLLM(engine_kwargs={"quality": preset, **parts}, kv_cache_bytes=KV_BYTES)
    index_llm = LlamaIndexLLM(engine_kwargs={"quality": preset, "kv_cache_bytes": KV_BYTES, **parts})
    try:
        assert chat.llm.config == ref.config
        assert index_llm.lazyllm.config == ref.config
        assert (chat.chunk_context, index_llm.chunk_context) == (ref.chunk_context, ref.chunk_context)
        assert chat._identifying_params["reuse"] == ref.reuse
        with pytest.raises(ValueError, match="given twice"):  # pydantic wraps it
            ChatLazyLLM(reuse="block", engine_kwargs={"reuse": "none", **parts}, kv_cache_bytes=KV_BYTES)
    finally:
        for llm in (ref, chat.llm, index_llm.lazyllm):
            llm.close()


# -- message conversion (no model) -------------------------------------------------

def test_messages_to_request():
    docs = [Document("Doc A text.", id="a", metadata={"src": "x"}), Document("Doc B text.", id="b")]
    msgs = ([SystemMessage("Sys one."), SystemMessage("Sys two."), HumanMessage("hello"), AIMessage("hi there")]
            + documents_to_messages(docs, "What is A?"))
    req = messages_to_request(msgs)
    assert req.system == "Sys one.\n\nSys two."
    assert [(c.id, c.text, c.metadata) for c in req.chunks] == [("a", "Doc A text.", {"src": "x"}),
                                                               ("b", "Doc B text.", {})]
    assert req.question == f"What is A?\n\n{HISTORY_HEADER}\nUser: hello\nAssistant: hi there"
    # documents in their own message before the question (the chunk_prompt layout)
    req2 = messages_to_request(documents_to_messages(docs) + [HumanMessage("Q?")])
    assert req2.question == "Q?" and [c.id for c in req2.chunks] == ["a", "b"]
    # titles, base64 text
    block = {"type": "text-plain", "mime_type": "text/plain", "title": "T",
             "base64": base64.b64encode(b"body").decode(), "id": "t"}
    c = messages_to_request([HumanMessage(content=[block, {"type": "text", "text": "Q?"}])]).chunks[0]
    assert (c.text, c.id, c.metadata) == ("T\n\nbody", "t", {"title": "T"})
    with pytest.raises(InvalidRequestError):
        messages_to_request([HumanMessage(content=[{"type": "image", "url": "http://x/y.png"},
                                                   {"type": "text", "text": "Q?"}])])
    with pytest.raises(InvalidRequestError):
        messages_to_request([SystemMessage("only a system message")])


def test_tagged_prompt_round_trip():
    msgs = documents_to_messages([Document('He said "hi" & <left>.', id="q&a", metadata={"k": [1, 2]}),
                                  "plain\n\n  spaced  \n"], "Why?", system="Be kind.")
    req = messages_to_request(msgs)
    back = decode_prompt(encode_prompt(req))
    assert back == req
    with pytest.raises(InvalidRequestError):
        encode_prompt(type(req)("q", [Chunk("x\n</lazyllm-document>\ny")]))


def test_llama_index_chat_to_request():
    msgs = [ChatMessage(role="system", content="S."),
            ChatMessage(role="user", content="earlier"),
            ChatMessage(role="assistant", content="reply"),
            ChatMessage(role="user", blocks=[DocumentBlock(data=b"doc text", document_mimetype="text/plain"),
                                             TextBlock(text="Q?")])]
    req = chat_to_request(msgs, system_prompt="Base.")
    assert req.system == "Base.\n\nS."
    assert [c.text for c in req.chunks] == ["doc text"]
    assert req.question == f"Q?\n\n{HISTORY_HEADER}\nUser: earlier\nAssistant: reply"


# -- LlamaIndex --------------------------------------------------------------------

def test_llamaindex_query_engine_answers_and_reuses_chunks(collection, make_engine):
    a, b, shared = _overlap(collection)
    engine = make_engine()
    llm = LlamaIndexLLM(llm=engine, max_new_tokens=NEW_TOKENS)
    md = llm.metadata
    assert (md.model_name, md.num_output, md.is_chat_model) == (engine.model_name, NEW_TOKENS, True)
    assert md.context_window == engine.model.spec.max_context
    qe = _li_engine(collection, llm)
    first, second = qe.query(Q1), qe.query(Q2)
    for r, ids in ((first, a), (second, b)):
        assert r.response.strip()
        assert [n.node.node_id for n in r.source_nodes] == ids
        assert r.metadata["lazyllm"]["chunk_ids"] == ids  # one chunk per node, node id as chunk id
        assert r.metadata[ids[0]] == META[ids[0]]
    reused = sum(_chunk_tokens(engine, CORPUS[i]) for i in shared)
    assert first.metadata["lazyllm"]["cached_tokens"] == 0
    assert second.metadata["lazyllm"]["cached_tokens"] >= reused > 0
    print(f"\nLlamaIndex cold TTFT {first.metadata['lazyllm']['ttft_s'] * 1e3:7.1f} ms, "
          f"warm TTFT {second.metadata['lazyllm']['ttft_s'] * 1e3:7.1f} ms "
          f"(cached {second.metadata['lazyllm']['cached_tokens']} of "
          f"{second.metadata['lazyllm']['prompt_tokens']} prompt tokens)")
    print(f"  Q1: {first.response!r}\n  Q2: {second.response!r}")
    # streaming gives the same text
    streamed = _li_engine(collection, llm, streaming=True).query(Q2)
    assert isinstance(streamed, StreamingResponse)
    assert "".join(streamed.response_gen) == second.response
    assert streamed.metadata["lazyllm"]["cached_tokens"] > 0

    async def run():
        r = await _li_engine(collection, llm).aquery(Q1)
        s = await _li_engine(collection, llm, streaming=True).aquery(Q1)
        return r.response, "".join([t async for t in s.async_response_gen()])

    assert asyncio.run(run()) == (first.response, first.response)


def test_llamaindex_llm_surface(make_engine):
    engine = make_engine()
    llm = LlamaIndexLLM(llm=engine, max_new_tokens=NEW_TOKENS, system_prompt=SYSTEM)
    chunks = [Chunk(CORPUS["rome"], id="rome")]
    r = llm.complete("Where did gladiators fight?", chunks=chunks)
    assert r.text.strip() and r.additional_kwargs["chunk_ids"] == ["rome"] and r.raw.text == r.text
    streamed = list(llm.stream_complete("Where did gladiators fight?", chunks=chunks))
    assert streamed[-1].text == r.text and "".join(x.delta for x in streamed) == r.text
    assert streamed[-1].additional_kwargs["cached_tokens"] > 0
    doc = DocumentBlock(data=CORPUS["rome"].encode(), document_mimetype="text/plain")
    msgs = [ChatMessage(role="user", blocks=[doc, TextBlock(text="Where did gladiators fight?")])]
    c = llm.chat(msgs)
    assert c.message.content == r.text  # same request, whichever way the document came
    assert "".join(x.delta for x in llm.stream_chat(msgs)) == r.text

    async def run():
        a = await llm.acomplete("Where did gladiators fight?", chunks=chunks)
        b = await llm.achat(msgs)
        s = [x.delta async for x in await llm.astream_chat(msgs)]
        t = [x.delta async for x in await llm.astream_complete("Where did gladiators fight?", chunks=chunks)]
        return a.text, b.message.content, "".join(s), "".join(t)

    assert asyncio.run(run()) == (r.text,) * 4
    with pytest.raises(InvalidRequestError):
        llm.complete("x", repetition_penalty=1.2)


def test_llamaindex_in_memory_index_one_liner(make_engine):
    engine = make_engine()
    llm = LlamaIndexLLM(llm=engine, max_new_tokens=NEW_TOKENS)
    docs = [LIDocument(text=t, id_=k, metadata=META[k]) for k, t in CORPUS.items()]
    index = VectorStoreIndex.from_documents(docs, embed_model=BundledMiniLMEmbedding())
    synth = ChunkSynthesizer(llm, metadata_mode=MetadataMode.LLM)
    nodes = list(index.docstore.docs.values())
    assert synth.warm(nodes)["computed_tokens"] > 0
    r = index.as_query_engine(llm=llm, response_synthesizer=synth, similarity_top_k=2).query(Q1)
    assert r.response.strip()
    assert r.source_nodes[0].node.ref_doc_id == "louvre"
    chunk_tokens = sum(_chunk_tokens(engine, synth.node_to_chunk(n.node).text) for n in r.source_nodes)
    assert r.metadata["lazyllm"]["cached_tokens"] >= chunk_tokens  # warmed exactly as queried
    assert "city: " in synth.node_to_chunk(TextNode(text="t", metadata={"city": "x"})).text
    with pytest.raises(InvalidRequestError):
        ChunkSynthesizer(object())


# Any HTTP(S) request (a model download, telemetry) goes to a closed local port and fails.
OFFLINE_PROXIES = {k: "http://127.0.0.1:9" for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                                                     "http_proxy", "https_proxy", "all_proxy")}
OFFLINE_PROXIES.update(NO_PROXY="", no_proxy="")


@pytest.mark.parametrize("script", ["langchain_rag.py", "llamaindex_rag.py"])
def test_examples_run(script):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "examples", script)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               **OFFLINE_PROXIES)
    out = subprocess.run([sys.executable, path, "--max-new-tokens", "8"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]
    cached = [int(line.split("cached ", 1)[1].split(",", 1)[0]) for line in out.stdout.splitlines()
              if "cached " in line and "prompt " in line]
    assert len(cached) >= 2 and cached[0] == 0 and cached[1] > 0, out.stdout
