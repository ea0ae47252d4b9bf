"""Every bad-input class gets a clear lazyllm.InvalidRequestError (a ValueError) at each
public entry point — the engine, the LangChain chat and string models, the LlamaIndex LLM —
and the engine keeps serving afterwards."""
import pytest

from lazyllm import Chunk, InvalidRequestError, LazyLLM
from tests.conftest import make_tiny

GOOD_Q = "fine?"
GOOD_DOCS = ["a document about things"]

# (name, question, chunks, sampling overrides)
CASES = [
    ("wrong type question", 42, GOOD_DOCS, {}),
    ("empty question", "", GOOD_DOCS, {}),
    ("whitespace question", "  \n\t ", GOOD_DOCS, {}),
    ("empty chunk", GOOD_Q, ["ok", "   "], {}),
    ("wrong type chunk", GOOD_Q, [3.5], {}),
    ("too long", GOOD_Q, ["word " * 5000], {}),
    ("thousands of tiny chunks", GOOD_Q, ["x"] * 5000, {}),
    ("duplicate ids", GOOD_Q, [Chunk("a", id="d"), Chunk("b", id="d")], {}),
    ("invalid utf-8", "bad \udcff text", GOOD_DOCS, {}),
    ("control character", "nul \x00 inside", GOOD_DOCS, {}),
    ("negative temperature", GOOD_Q, GOOD_DOCS, {"temperature": -0.5}),
    ("top_p out of range", GOOD_Q, GOOD_DOCS, {"top_p": 1.5}),
    ("negative max_new_tokens", GOOD_Q, GOOD_DOCS, {"max_new_tokens": -3}),
    ("huge max_new_tokens", GOOD_Q, GOOD_DOCS, {"max_new_tokens": 10**9}),
    ("stop of the wrong type", GOOD_Q, GOOD_DOCS, {"stop": [1, 2]}),
]


@pytest.fixture(scope="module")
def engine(tokenizer):
    llm = LazyLLM(model=make_tiny("llama", seed=4), tokenizer=tokenizer, kv_cache_bytes=16 << 20, quality="isolated")
    yield llm
    llm.close()


def _serving(llm):
    assert llm.generate(GOOD_Q, chunks=GOOD_DOCS, max_new_tokens=2).usage.completion_tokens >= 1


@pytest.mark.parametrize("name,q,chunks,kw", CASES, ids=[c[0] for c in CASES])
def test_engine_entry_point(engine, name, q, chunks, kw):
    with pytest.raises(InvalidRequestError):
        engine.generate(q, chunks=chunks, **{"max_new_tokens": 2, **kw})
    _serving(engine)


@pytest.mark.parametrize("name,q,chunks,kw", CASES, ids=[c[0] for c in CASES])
def test_langchain_entry_points(engine, name, q, chunks, kw):
    from langchain_core.documents import Document
    from langchain_core.messages import HumanMessage

    from lazyllm.integrations.langchain import ChatLazyLLM, LazyLLMText, documents_to_messages, format_documents

    if any(not isinstance(c, (str, Chunk)) for c in chunks) or not isinstance(q, str):
        # LangChain itself refuses non-str content before it reaches us; check its error is a clear one
        if isinstance(q, str):  # a document block whose text is not a string
            content = [{"type": "text-plain", "mime_type": "text/plain", "text": chunks[0]},
                       {"type": "text", "text": q}]
        else:
            content = [q]
        with pytest.raises((InvalidRequestError, ValueError, TypeError)):
            ChatLazyLLM(llm=engine).invoke([HumanMessage(content=content)])
        _serving(engine)
        return
    if name == "duplicate ids":
        docs = [Document(page_content=c.text, id=c.id) for c in chunks]
    else:
        docs = [Document(page_content=c if isinstance(c, str) else c.text) for c in chunks]
    sampling = {("max_tokens" if k == "max_new_tokens" else k): v for k, v in kw.items()}
    chat = ChatLazyLLM(llm=engine, max_tokens=2)
    with pytest.raises(InvalidRequestError):
        if "stop" in sampling:
            chat.invoke(documents_to_messages(docs, question=q), stop=sampling["stop"])
        else:
            chat.bind(**sampling).invoke(documents_to_messages(docs, question=q))
    _serving(engine)
    text = LazyLLMText(llm=engine, max_tokens=2)
    with pytest.raises(InvalidRequestError):
        prompt = format_documents(docs) + "\n" + q
        if "stop" in sampling:
            text.invoke(prompt, stop=sampling["stop"])
        else:
            text.bind(**sampling).invoke(prompt)
    _serving(engine)


@pytest.mark.parametrize("name,q,chunks,kw", CASES, ids=[c[0] for c in CASES])
def test_llama_index_entry_point(engine, name, q, chunks, kw):
    from lazyllm.integrations.llama_index import LlamaIndexLLM

    llm = LlamaIndexLLM(llm=engine, max_new_tokens=2)
    with pytest.raises(InvalidRequestError):
        llm.complete(q, chunks=chunks, **kw)
    _serving(engine)
