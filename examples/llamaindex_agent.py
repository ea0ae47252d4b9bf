"""A LlamaIndex FunctionAgent on lazyllm, offline on a CPU: a retriever tool over a
VectorStoreIndex (bundled MiniLM embeddings) and a calculator, on the default 135M model.

``ChunkRetrieverTool`` returns the retrieved nodes one block each, so they reach the engine as
chunks: the agent's step after the retrieval computes their KV and every later step reads it
from the cache; watch ``cached chunk`` tokens. Each call is held to its tool's schema by the
grammar; the LLM is built with ``tool_choice="required"`` because the 135M model answers in
text under "auto" (README, "Structured output and tool calling"), so the agent calls until
``max_iterations``.

    python examples/llamaindex_agent.py [--model PATH]
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import operator

from llama_index.core import Document, VectorStoreIndex
from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
from llama_index.core.tools import FunctionTool, ToolMetadata
from pydantic import BaseModel, Field

from lazyllm.integrations.llama_index import BundledMiniLMEmbedding, ChunkRetrieverTool, LlamaIndexLLM

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


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with numbers and + - * / (e.g. '687 / 365')."""
    try:
        return str(_eval(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"


class SearchArgs(BaseModel):
    # bounded: a 135M model otherwise tends to repeat itself inside a string
    input: str = Field(max_length=32, description="what to look for")


async def run(agent: FunctionAgent, question: str) -> None:
    handler = agent.run(question, max_iterations=3)
    step = 0
    async for ev in handler.stream_events():
        if isinstance(ev, AgentOutput) and ev.raw is not None:
            step, u = step + 1, ev.raw.usage
            print(f"step {step}: prompt {u.prompt_tokens} tokens, cached {u.cached_tokens} (cached chunk "
                  f"{u.cached_chunk_tokens}), chunks {len(ev.raw.chunk_ids)}")
        elif isinstance(ev, ToolCallResult):
            nodes = ev.tool_output.raw_output if ev.tool_name == "search" else None
            shown = [n.node.ref_doc_id for n in nodes] if nodes else ev.tool_output.content
            print(f"   {ev.tool_name}({ev.tool_kwargs}) -> {shown!r:.80}")
    try:
        await handler
    except Exception as e:  # forced to call, the agent stops at max_iterations
        print(f"   stopped: {str(e)[:80]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path or hub id (default: the embedded model)")
    args = ap.parse_args()
    docs = [Document(text=t, id_=k) for k, t in CORPUS.items()]
    index = VectorStoreIndex.from_documents(docs, embed_model=BundledMiniLMEmbedding())
    search = ChunkRetrieverTool(index.as_retriever(similarity_top_k=2), ToolMetadata(
        name="search", description="Search the planet documents.", fn_schema=SearchArgs))
    llm = LlamaIndexLLM(model_name=args.model, max_new_tokens=64, tool_choice="required")
    agent = FunctionAgent(tools=[search, FunctionTool.from_defaults(fn=calculator, fn_schema=CalculatorArgs)], llm=llm,
                          system_prompt="Use the tools: search the documents, then calculate.")
    try:
        asyncio.run(run(agent, "How many Earth years does a year on Mars last? Search for 'year on Mars', "
                               "then calculate the days of a Mars year divided by 365."))
    finally:
        llm.lazyllm.close()


if __name__ == "__main__":
    main()
