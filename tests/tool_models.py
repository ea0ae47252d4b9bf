"""Tool argument models as users write them, shared by the tool tests in process
(tests/api/test_tool_schemas.py) and over HTTP (tests/server/test_remote_tools.py): a nested
model (Pydantic puts ``Address`` in ``$defs`` and refers to it with ``$ref``) and a recursive
one, each with bounds a tiny random model's calls stay inside only through the grammar;
``tool``, the OpenAI function tool of a model as ``openai.pydantic_function_tool`` sends it;
and ``save``, a function taking a model argument (a LlamaIndex ``FunctionTool``'s schema then
has ``$defs``), which records what it was called with in ``SAVED``. No postponed annotations:
LlamaIndex reads ``save``'s annotation as a class, not a string."""
from pydantic import BaseModel, Field


class Address(BaseModel):
    street: str = Field(max_length=12)
    city: str = Field(max_length=10)


class Person(BaseModel):
    """Save a person."""

    name: str = Field(max_length=10)
    home: Address


class Node(BaseModel):
    """A tree of numbers."""

    value: int = Field(ge=0, le=9)
    children: list["Node"] = Field(default_factory=list, max_length=2)


def tool(name: str, model: type[BaseModel]) -> dict:
    """An OpenAI function tool whose parameters are the model's own schema, $defs and $refs
    as Pydantic writes them (what openai.pydantic_function_tool sends)."""
    return {"type": "function", "function": {"name": name, "description": model.__doc__ or "",
                                             "parameters": model.model_json_schema()}}


SAVED: list = []


def save(person: Person) -> str:
    """Save a person."""
    SAVED.append(Person.model_validate(person))
    return "saved"
