"""quality='block-ft': a Block-Attention fine-tuned checkpoint loads from a local folder and
gets the prompt layout it was trained with (tiny random checkpoints of the same format)."""
import pytest

from lazyllm import Chunk, LazyLLM
from lazyllm.inputs.prompt_blockft import INSTRUCTION, SYSTEM, BlockFTPromptBuilder
from tests.conftest import make_tiny
from tests.hf_reference import hf_greedy

LLAMA3_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
                   "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TULU_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}<|system|>\n{% elif m['role'] == 'user' %}"
                 "<|user|>\n{% else %}<|assistant|>\n{% endif %}{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
DOCS = [Chunk("Halley's Comet returns about every 76 years.", metadata={"title": "Halley's Comet"}),
        Chunk("Titan has lakes of liquid methane.", id="Titan"),
        "- Title: Io\nIo is volcanically active."]


def _checkpoint(tmp_path, tokenizer, style):
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    if style == "llama3":
        tok.add_special_tokens({"additional_special_tokens": [
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
        tok.chat_template = LLAMA3_TEMPLATE
    else:
        tok.chat_template = TULU_TEMPLATE
    model = make_tiny("llama", seed=5, vocab_size=len(tok))
    path = tmp_path / f"block-ft-{style}"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("style", ["llama3", "tulu"])
def test_block_ft_checkpoint_gets_its_training_layout(tmp_path, tokenizer, style):
    path, model = _checkpoint(tmp_path, tokenizer, style)
    llm = LazyLLM(str(path), quality="block-ft", kv_cache_bytes=16 << 20, progress=False)
    assert isinstance(llm.prompts, BlockFTPromptBuilder) and llm.prompts.layout == style
    assert (llm.reuse, llm.chunk_context, llm.recompute_ratio) == ("lazy", "isolated", 0.0)
    out = llm.generate("How often does Halley's Comet return?", chunks=DOCS, max_new_tokens=6)
    dec = [llm.tokenizer.decode(ids) for _, ids in out.prompt_segments]
    docs = ["- Title: Halley's Comet\nHalley's Comet returns about every 76 years.\n",
            "- Title: Titan\nTitan has lakes of liquid methane.\n", "- Title: Io\nIo is volcanically active.\n"]
    question = f"{INSTRUCTION}\nQuestion: How often does Halley's Comet return?"
    if style == "llama3":
        assert dec[0] == f"<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{SYSTEM}\n\n"
        assert dec[-1] == (f"<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{question}"
                           "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    else:
        assert dec[0] == f"<|user|>\n{SYSTEM}\n\n"
        assert dec[-1] == f"\n\n{question}\n<|assistant|>\n"
    assert dec[1:-1] == docs
    # the blocks attend as in block fine-tuning: each to itself, the question to everything
    segs = [(k, ids) for k, ids in out.prompt_segments]
    assert out.token_ids == hf_greedy(model, segs, "lazy", "isolated", 6, llm.eos_token_ids)
    # the trained system sentence unless the request brings its own
    own = llm.prompts.build("q?", [Chunk("x")], "Be brief.")
    assert llm.tokenizer.decode(own[0].ids).endswith("Be brief.\n\n")
    llm.close()


def test_chatml_layout_on_the_default_tokenizer(tokenizer):
    b = BlockFTPromptBuilder(tokenizer)
    assert b.layout == "chatml"
    segs = b.build("Why?", [Chunk("text", id="T")], None)
    assert tokenizer.decode(segs[0].ids) == f"<|im_start|>system\n{SYSTEM}\n\n"
    assert tokenizer.decode(segs[1].ids) == "- Title: T\ntext\n"
    assert tokenizer.decode(segs[2].ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
