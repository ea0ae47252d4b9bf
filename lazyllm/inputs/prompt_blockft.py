"""The prompt layout that Block-Attention fine-tuned checkpoints were trained with, for
``LazyLLM(..., quality="block-ft")``.

Block fine-tuning (Block-Attention, Ma et al., github.com/TemporaryLoRA/Block-Attention and
its fork haochengxia/Block-Attention) trains a model on prompts cut into blocks: a fixed
system block, one block per retrieved document, each attending only to itself, and a last
block (the question) attending to everything. That is lazyllm's ``chunk_context="isolated"``
with the blocks as prefix, chunks and suffix. The checkpoints expect the training layout:

* system block: ``You are an intelligent AI assistant. Please answer questions based on the
  user's instructions. Below are some reference documents that may help you in answering
  the user's question.`` followed by a blank line, in the system turn (Llama 3 header
  tokens, ``hxia7/Llama-3.2-1B-Block-FT``) or at the start of the user turn (Tulu 3's
  ``<|user|>`` format, ``ldsjmdy/Tulu3-Block-FT``), without the template's date lines;
* each document: ``- Title: {title}\\n{text}\\n``, tokenized on its own;
* question block: the end of that turn, then ``Please write a high-quality answer for the
  given question using only the provided search documents (some of which might be
  irrelevant).\\nQuestion: {question}`` and the assistant header.

The layouts are written out here rather than rendered with the tokenizer's chat template,
whose current versions add lines (Llama 3.1/3.2's knowledge and today's dates) that the
training prompts did not have. ChatML models (Qwen3: ``hxia7/Qwen3-8B-Block-FT``) get the
Llama 3 layout in ChatML tokens with Qwen3's empty think block: our reading of the same
recipe, not confirmed against that checkpoint's training script.

A document's title is ``chunk.metadata["title"]``, else ``chunk.id``, else empty; a text that
already starts with ``- Title:`` is used as is. A ``system`` passed to a request replaces the
trained system sentence.
"""
from __future__ import annotations

from ..engine.request import Segment
from ..errors import InvalidRequestError
from ..types import Chunk
from .prompt import PromptBuilder, check_text

SYSTEM = ("You are an intelligent AI assistant. Please answer questions based on the user's instructions. "
          "Below are some reference documents that may help you in answering the user's question.")
INSTRUCTION = ("Please write a high-quality answer for the given question using only the provided search "
               "documents (some of which might be irrelevant).")

# (prefix before the system text, text between the documents and the instruction, tail after the question)
LAYOUTS = {
    "llama3": ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
               "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n",
               "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "tulu": ("<|user|>\n", "\n\n", "\n<|assistant|>\n"),
    "chatml": ("<|im_start|>system\n", "<|im_end|>\n<|im_start|>user\n",
               "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
}


def detect_layout(tokenizer) -> str:
    """``"tulu"`` when the chat template speaks ``<|user|>``, ``"llama3"`` when the vocabulary
    has Llama 3's header tokens, ``"chatml"`` for ``<|im_start|>``; else an error."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = " ".join(str(v) for v in template.values())
    vocab = tokenizer.get_vocab()
    if "<|user|>" in template:
        return "tulu"
    if "<|start_header_id|>" in vocab:
        return "llama3"
    if "<|im_start|>" in vocab:
        return "chatml"
    raise InvalidRequestError("quality='block-ft' knows the Block-Attention layouts of Llama 3, Tulu 3 and "
                              "ChatML (Qwen) tokenizers; this tokenizer is none of them")


class BlockFTPromptBuilder(PromptBuilder):
    """Prefix / chunk / suffix segments in the Block-Attention training layout."""

    def __init__(self, tokenizer, layout: str | None = None, encodings=None):
        super().__init__(tokenizer, encodings=encodings)
        self.layout = layout or detect_layout(tokenizer)
        if self.layout not in LAYOUTS:
            raise InvalidRequestError(f"unknown block-ft layout {self.layout!r}; one of {tuple(LAYOUTS)}")

    def chunk_text(self, chunk: Chunk) -> str:
        text = chunk.text.strip()
        if text.startswith("- Title:"):
            return text + "\n"
        title = chunk.metadata.get("title") if chunk.metadata else None
        if title is None:
            title = chunk.id or ""
        return f"- Title: {str(title).strip()}\n{text}\n"

    def build(self, question: str, chunks: list[Chunk], system: str | None) -> list[Segment]:
        check_text(question, "question")
        if system is not None and not isinstance(system, str):
            raise InvalidRequestError(f"system must be a str or None, got {type(system).__name__}")
        if system is None or not system.strip():
            system = SYSTEM
        else:
            check_text(system, "system")
        for i, c in enumerate(chunks):
            check_text(c.text, f"chunks[{i}].text")
        head, mid, tail = LAYOUTS[self.layout]
        segs = [self.prefix_segment(f"{head}{system.strip()}\n\n")]
        segs += self.chunk_segments(chunks)
        segs.append(Segment("suffix", self.encode(f"{mid}{INSTRUCTION}\nQuestion: {question.strip()}{tail}")))
        return segs


def prompt_builder(tokenizer, layout: str | None = None,
                   packet_ids: tuple[list[int], list[int]] | None = None, encodings=None) -> PromptBuilder:
    """The prompt builder of a configuration: ``layout`` ``None`` or ``"chat"`` (the
    ``prompt_layout`` option's default) for the model's chat template (with the packet's
    virtual ids around each chunk, if any), or a Block-Attention training layout (a
    ``LAYOUTS`` name, or ``"auto"`` / ``"block-ft"``: the tokenizer's); ``encodings``: its
    cache of chunk encodings (``inputs.encodings.ChunkEncodings``) or ``None``."""
    if layout in (None, "chat"):
        return PromptBuilder(tokenizer, packet_ids, encodings)
    return BlockFTPromptBuilder(tokenizer, None if layout in ("auto", "block-ft") else layout, encodings)


__all__ = ["BlockFTPromptBuilder", "LAYOUTS", "SYSTEM", "INSTRUCTION", "detect_layout", "prompt_builder"]
