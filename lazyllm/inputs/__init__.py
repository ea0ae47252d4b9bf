"""The front door: where a caller's arguments become the engine's ``Request``.

It sits between ``lazyllm.api`` and the engine and is the only place a ``Request`` is made
(``InputProcessor``; a test checks that no other module constructs one). It owns the prompt
builders (``PromptBuilder``, the Block-Attention layout's ``BlockFTPromptBuilder``), the one
rule that renders a request or a conversation into segments (``conversation``), and the chunk
keys a router computes outside the engine (``keys``).
"""
from __future__ import annotations

from .keys import ChunkKeyer, key_identity
from .processor import InputProcessor
from .prompt import PromptBuilder, check_text
from .prompt_blockft import BlockFTPromptBuilder, prompt_builder

__all__ = ["BlockFTPromptBuilder", "ChunkKeyer", "InputProcessor", "PromptBuilder", "check_text", "key_identity",
           "prompt_builder"]
