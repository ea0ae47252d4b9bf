"""A RAG agent with LangChain tools on lazyllm, offline on a CPU: a retriever tool over chroma
(bundled MiniLM embeddings) and a calculator tool, on the default 135M model.

Every step's tool call is held to the tool's schema by the grammar, so even the small model
calls the tools with valid arguments. The retriever returns its documents as the tool's
artifact; they travel as chunks, so each step after the retrieval reads their KV from cache:
watch ``cached`` grow step by step.

    python examples/rag_agent.py [--db PATH] [--model PATH]
"""
from __future__ import annotations

import argparse
import ast
import operator
import tempfile

from chromadb.config import Settings
from langchain_chroma import Chroma
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from lazyllm.integrations.langchain import BundledMiniLMEmbeddings, ChatLazyLLM

CORPUS = {
    "mercury": "Mercury is the closest planet to the Sun. A year on Mercury lasts 88 days.",
    "venus": "Venus is the hottest planet. A year on Venus lasts 225 days.",
    "earth": "Earth is the only planet known to support life. A year on Earth lasts 365 days.",
    "mars": "Mars is called the Red Planet. A year on Mars lasts 687 days.",
    "jupiter": "Jupiter is the largest planet. A year on Jupiter lasts 4333 days.",
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("only numbers and + - * /")


class CalculatorArgs(BaseModel):
    # the grammar holds the argument to this pattern: only arithmetic can be written
    expression: str = Field(max_length=24, pattern=r"^[0-9]+( *[-+*/] *[0-9]+)*$", description="e.g. '687 / 365'")


class SearchArgs(BaseModel):
    # bounded: a 135M model otherwise tends to repeat itself inside a string
    query: str = Field(max_length=32, description="what to look for")


@tool(args_schema=CalculatorArgs)
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with numbers and + - * / (e.g. '687 / 365')."""
    try:
        return str(_eval(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


def make_retriever(db: str):
    store = Chroma.from_texts(list(CORPUS.values()), embedding=BundledMiniLMEmbeddings(), ids=list(CORPUS),
                              collection_name="planets", persist_directory=db,
                              client_settings=Settings(anonymized_telemetry=False))
    retriever = store.as_retriever(search_kwargs={"k": 2})

    @tool(response_format="content_and_artifact", args_schema=SearchArgs)
    def search(query: str) -> tuple[str, list[Document]]:
        """Search the planet documents."""
        docs = retriever.invoke(query)
        return "\n".join(d.page_content for d in docs), docs

    return search


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="chroma folder (default: a temporary one)")
    ap.add_argument("--model", default=None, help="model path or hub id (default: the embedded model)")
    args = ap.parse_args()
    search = make_retriever(args.db or tempfile.mkdtemp(prefix="lazyllm-chroma-"))
    tools = {"search": search, "calculator": calculator}
    llm = ChatLazyLLM.from_model_id(args.model, max_tokens=64)
    messages = [SystemMessage("Use the tools: search the documents, then calculate."),
                HumanMessage("How many Earth years does a year on Mars last? Search for 'year on Mars', "
                             "then calculate the days of a Mars year divided by 365.")]
    # a fixed plan, each step's call forced by tool_choice (a 135M model does not plan);
    # with a larger model, bind the tools once with tool_choice="auto" and loop until no call
    plan = ["search", "calculator", "none"]
    try:
        for step, choice in enumerate(plan, 1):
            ai = llm.bind_tools(list(tools.values()), tool_choice=choice).invoke(messages)
            meta, usage = ai.response_metadata, ai.usage_metadata
            cached = usage["input_token_details"]["cache_read"]
            print(f"step {step}: prompt {usage['input_tokens']} tokens, cached {cached} (of which document chunks "
                  f"{meta['cached_chunk_tokens']}), chunks {meta['chunk_ids']}")
            messages.append(ai)
            for call in ai.tool_calls:
                result = tools[call["name"]].invoke(call)
                print(f"   {call['name']}({call['args']}) -> {result.content[:80]!r}")
                messages.append(result)
            if not ai.tool_calls:
                print(f"   answer: {ai.text.strip()!r}")
    finally:
        llm.llm.close()


if __name__ == "__main__":
    main()
