"""Fidelity cases: a question, its retrieved documents, an optional system prompt and an
optional reference answer, read from JSONL, dicts, ``Case`` objects or a retriever."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..types import Chunk


@dataclass
class Case:
    """One question with its retrieved documents (``str`` or ``Chunk``)."""

    question: str
    documents: list[str | Chunk]
    system: str | None = None
    reference: str | None = None
    id: str | None = None


def document_text(doc: Any) -> str | Chunk:
    """A retrieved document as a chunk: a ``str`` or ``Chunk`` as is, a LangChain
    ``Document`` (``page_content``), a LlamaIndex ``NodeWithScore`` or ``TextNode``
    (``get_content()``), or a dict with ``text`` / ``page_content``."""
    if isinstance(doc, (str, Chunk)):
        return doc
    if isinstance(doc, Mapping):
        for key in ("text", "page_content", "content"):
            if isinstance(doc.get(key), str):
                return doc[key]
        raise TypeError(f"a document dict needs a 'text' field, got keys {sorted(doc)}")
    if isinstance(getattr(doc, "page_content", None), str):  # LangChain Document
        return doc.page_content
    node = getattr(doc, "node", None)  # LlamaIndex NodeWithScore
    if node is not None:
        doc = node
    get = getattr(doc, "get_content", None)  # LlamaIndex TextNode / Node
    if callable(get):
        return get()
    if isinstance(getattr(doc, "text", None), str):
        return doc.text
    raise TypeError(f"cannot read a document's text from a {type(doc).__name__}")


def _case(obj: Any, i: int) -> Case:
    if isinstance(obj, Case):
        return Case(obj.question, [document_text(d) for d in obj.documents], obj.system, obj.reference,
                    obj.id if obj.id is not None else str(i))
    if not isinstance(obj, Mapping):
        raise TypeError(f"case {i}: expected a Case or a dict, got {type(obj).__name__}")
    q = obj.get("question")
    if not isinstance(q, str) or not q:
        raise ValueError(f"case {i}: needs a non-empty 'question'")
    docs = next((obj[k] for k in ("documents", "chunks", "contexts", "nodes") if k in obj), None)
    if not isinstance(docs, Sequence) or isinstance(docs, str):
        raise ValueError(f"case {i}: needs 'documents', a list")
    ref = next((obj[k] for k in ("reference", "answer", "reference_answer") if obj.get(k) is not None), None)
    return Case(q, [document_text(d) for d in docs], obj.get("system"), ref, str(obj.get("id", i)))


def load_cases(path: str | os.PathLike) -> list[Case]:
    """Cases from a JSONL file: one JSON object a line with ``question``, ``documents`` (a
    list of strings or ``{"text": ...}``), and optional ``system``, ``reference`` and ``id``.
    Blank lines and lines starting with ``#`` are skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from None
            out.append(_case(obj, len(out)))
    return out


def cases_from_retriever(retriever: Any, questions: Sequence[str], *, references: Sequence[str | None] | None = None,
                         system: str | None = None) -> list[Case]:
    """Cases whose documents come from a retriever: a LangChain retriever
    (``retriever.invoke(question)`` returns ``Document``s) or a LlamaIndex retriever
    (``retriever.retrieve(question)`` returns ``NodeWithScore``s)."""
    if references is not None and len(references) != len(questions):
        raise ValueError("references must have one entry per question")
    out = []
    for i, q in enumerate(questions):
        if hasattr(retriever, "invoke"):
            docs = retriever.invoke(q)
        elif hasattr(retriever, "retrieve"):
            docs = retriever.retrieve(q)
        else:
            raise TypeError("retriever must have .invoke (LangChain) or .retrieve (LlamaIndex)")
        out.append(Case(q, [document_text(d) for d in docs], system,
                        None if references is None else references[i], str(i)))
    return out


def as_cases(cases: Any, retriever: Any, system: str | None) -> list[Case]:
    if isinstance(cases, (str, os.PathLike)):
        out = load_cases(cases)
    elif retriever is not None:
        qs = list(cases)
        if qs and all(isinstance(q, str) for q in qs):
            out = cases_from_retriever(retriever, qs, system=system)
        else:  # dicts / Cases without documents: fill them from the retriever
            out = []
            for i, c in enumerate(qs):
                c = dict(asdict(c)) if isinstance(c, Case) else dict(c)
                if not c.get("documents"):
                    c["documents"] = cases_from_retriever(retriever, [c["question"]])[0].documents
                out.append(_case(c, i))
    else:
        out = [_case(c, i) for i, c in enumerate(cases)]
    if system is not None:
        for c in out:
            c.system = c.system if c.system is not None else system
    if not out:
        raise ValueError("no cases")
    return out


