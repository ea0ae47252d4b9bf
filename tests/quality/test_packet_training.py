"""Packet training (self-distillation from full attention) and ``lazyllm adapt``: the
training forward gives the engine's logits, training lowers the loss on a tiny model in
seconds, and adapt turns documents into a packet file with a fidelity report on held-out
documents."""
import json

import pytest
import torch

from lazyllm import InvalidRequestError, LazyLLM
from tests.conftest import make_tiny

DOCS = [
    "The Eiffel Tower in Paris was completed in 1889 and is 330 metres tall.",
    "Mount Fuji is the highest mountain in Japan, rising 3,776 metres above sea level.",
    "The Great Wall of China stretches for more than 21,000 kilometres across northern China.",
    "Python was created by Guido van Rossum and first released in 1991.",
    "The Amazon river carries more water than any other river on Earth.",
    "Honeybees tell each other where flowers are with a waggle dance.",
    "The Sahara is the largest hot desert, covering about nine million square kilometres.",
    "Copper conducts electricity well and is used in most household wiring.",
]
QUESTION = "Which of these was completed in 1889?"
SYSTEM = "You are a concise assistant."


def _llm(model, tok, **kw):
    kw.setdefault("quality", "isolated")  # the configuration these tests were written for
    return LazyLLM(model=model, tokenizer=tok, kv_cache_bytes=64 << 20, **kw)


def test_training_forward_matches_engine_and_reduces_the_loss(tokenizer):
    """The differentiable student forward gives the engine's logits (isolated chunks with the
    packet), and a few Adam steps on a tiny model lower the distillation loss on its cases."""
    from lazyllm.quality.packet_training import (
        build_cases,
        init_packets,
        mean_loss,
        student_logits,
        student_mask,
        train_packets,
    )

    model = make_tiny("llama", seed=3)
    full = _llm(model, tokenizer, reuse="none")
    items = [dict(question=QUESTION, documents=DOCS[i:i + 3], system=SYSTEM) for i in range(2)]
    cases = build_cases(full, items, answer_tokens=6, progress=False)
    init = init_packets(model, tokenizer, 2, 2)
    before = mean_loss(model, cases, init, 2)
    p, log = train_packets(model, tokenizer, cases, k_header=2, k_trailer=2, steps=25, lr=0.05, init=init,
                           progress=False)
    after = mean_loss(model, cases, p.rows, p.k_header)
    assert after < 0.7 * before, (before, after, log["losses"])
    assert all(q.requires_grad for q in model.parameters())  # frozen while training only
    # the trained packet in the engine: the engine's logits equal the training forward's
    llm = _llm(model, tokenizer, packets=p)
    c = cases[0]
    sc = llm.score(QUESTION, chunks=DOCS[0:3], system=SYSTEM, continuation=c.answer, return_logits=True)
    segs = [(k, list(ids)) for k, ids in sc.prompt_segments]
    ids = torch.tensor([t for _, s in segs for t in s] + c.answer[:-1])
    mask = student_mask(segs, len(c.answer) - 1, p.k_header)
    with torch.no_grad():
        ref = student_logits(model, ids, mask, p.rows, llm.model.embed_rows, len(c.answer))
    torch.testing.assert_close(sc.logits, ref, rtol=1e-3, atol=1e-3)
    llm.close()
    full.close()


def test_adapt_makes_a_packet_and_reports_on_heldout_documents(tokenizer, tmp_path):
    from lazyllm.model.packets import load_packets
    from lazyllm.quality import adapt

    model = make_tiny("llama", seed=5)
    llm = _llm(model, tokenizer)
    res = adapt(llm, DOCS, out=tmp_path / "p.safetensors", cases=4, heldout=0.25, heldout_cases=2, steps=4,
                minutes=None, k_header=2, k_trailer=1, progress=False)
    p = load_packets(res.path)
    assert (p.k_header, p.k_trailer) == (2, 1) and p.info["train_documents"] == 6
    assert res.split == dict(train_documents=6, heldout_documents=2, train_cases=4, heldout_cases=2)
    names = [r["setting"] for r in res.report.rows]
    assert names[1:] == ["no packet", "packet"] and res.report.n_cases == 2
    assert res.heldout_loss_before is not None and res.heldout_loss_after is not None
    # the packet works in the engine for this model
    used = _llm(model, tokenizer, packets=res.path)
    assert used.generate(QUESTION, chunks=DOCS[:2], max_new_tokens=2).usage.prompt_tokens > 0
    used.close()
    llm.close()
    with pytest.raises(InvalidRequestError, match="at least 4"):
        adapt(llm, DOCS[:3], out=tmp_path / "q.safetensors")


def test_load_documents_from_folder_jsonl_and_objects(tmp_path):
    from lazyllm.quality.adapt import load_documents

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("Doc A text.")
    (tmp_path / "d" / "b.md").write_text("Doc B text.")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\x00")
    assert load_documents(tmp_path / "d") == ["Doc A text.", "Doc B text."]
    (tmp_path / "x.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps("two") + "\n"
                                      + json.dumps({"question": "q", "documents": ["three", "one"]}) + "\n")
    assert load_documents(tmp_path / "x.jsonl") == ["one", "two", "three"]

    class LCDoc:  # a LangChain Document's shape
        page_content = "from langchain"

    assert load_documents([LCDoc(), {"page_content": "dict"}]) == ["from langchain", "dict"]
    with pytest.raises(InvalidRequestError):
        load_documents(tmp_path / "missing")


def test_load_documents_skips_binary_files_and_names_bad_documents(tmp_path, caplog):
    """A folder's binary or non-UTF-8 files are skipped with a warning that names them; a file
    named itself that is not text, or a document with a NUL character, is an error naming it."""
    from lazyllm.quality.adapt import load_documents

    d = tmp_path / "d"
    d.mkdir()
    (d / "a.txt").write_text("Doc A text.")
    (d / "random.txt").write_bytes(bytes(range(256)) * 8)  # NUL bytes among them
    (d / "latin.md").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))  # not UTF-8
    with caplog.at_level("WARNING", logger="lazyllm"):
        assert load_documents(d) == ["Doc A text."]
    assert "random.txt" in caplog.text and "latin.md" in caplog.text
    with pytest.raises(InvalidRequestError, match="random.txt.*binary"):
        load_documents(d / "random.txt")
    with pytest.raises(InvalidRequestError, match="latin.md.*not UTF-8"):
        load_documents(d / "latin.md")
    (tmp_path / "x.jsonl").write_text(json.dumps("fine") + "\n" + json.dumps({"text": "a\x00b"}) + "\n")
    with pytest.raises(InvalidRequestError, match="x.jsonl:2: the document contains a NUL"):
        load_documents(tmp_path / "x.jsonl")
    with pytest.raises(InvalidRequestError, match=r"documents\[1\]"):
        load_documents(["fine", "a\x00b"])


def test_fit_documents_splits_a_long_document_into_pieces_that_fit():
    from lazyllm.quality.adapt import fit_documents

    words = lambda t: len(t.split())  # noqa: E731
    long = "one two three\n\nfour five six seven eight nine ten\neleven twelve"
    pieces = fit_documents([long, "short one"], words, 4)
    assert all(words(p) <= 4 for p in pieces)
    assert " ".join(pieces).split() == (long + " short one").split()  # nothing lost, order kept
    assert pieces[0] == "one two three" and pieces[-1] == "short one"


def test_adapt_splits_a_document_longer_than_a_case_allows(tokenizer, tmp_path):
    """A document too long to sit with the others of a case in the model's context is split, as
    a retriever's chunks would be, instead of failing with a context error."""
    from lazyllm.quality import adapt

    model = make_tiny("llama", seed=5, max_position_embeddings=768)
    llm = _llm(model, tokenizer)
    long = " ".join(f"The keeper logged storm {i} at the Halvorsen lighthouse." for i in range(60))  # ~3 KB
    res = adapt(llm, DOCS[:4] + [long], out=tmp_path / "p.safetensors", cases=4, heldout=0.25, heldout_cases=1,
                steps=2, minutes=None, k_header=1, k_trailer=1, report=False, progress=False)
    assert res.split["train_documents"] + res.split["heldout_documents"] > 5  # the long one became pieces
    llm.close()


def test_adapt_cli_writes_a_packet(tokenizer, tmp_path, capsys):
    from lazyllm.cli import main

    model = make_tiny("llama", seed=6)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    (tmp_path / "docs").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "docs" / f"{i}.txt").write_text(d)
    out = tmp_path / "p.safetensors"
    rc = main(["adapt", str(tmp_path / "docs"), "--model", str(tmp_path / "m"), "--device", "cpu", "--out", str(out),
               "--cases", "3", "--heldout-cases", "2", "--steps", "2", "--k-header", "1", "--k-trailer", "1",
               "--json", str(tmp_path / "r.json")])
    assert rc == 0 and out.is_file()
    text = capsys.readouterr().out
    assert "| packet |" in text and "LazyLLM(packets=" in text
    assert json.loads((tmp_path / "r.json").read_text())["split"]["train_documents"] == 6


def test_bridge_training_with_recompute_in_the_loop_lowers_the_loss(tokenizer):
    """A bridge packet (trailer recomputed per request) and per-layer bridge parameters train
    under the recompute the engine will run; the saved packet is a bridge packet the engine
    runs with the training forward's logits."""
    from lazyllm.quality.packet_training import (
        build_cases,
        init_packets,
        mean_loss,
        student_layout,
        student_logits,
        train_packets,
    )

    model = make_tiny("llama", seed=4)
    full = _llm(model, tokenizer, reuse="none")
    items = [dict(question=QUESTION, documents=DOCS[i:i + 3], system=SYSTEM) for i in range(2)]
    cases = build_cases(full, items, answer_tokens=6, progress=False)
    init = init_packets(model, tokenizer, 1, 2)
    before = mean_loss(model, cases, init, 1, bridge=True)
    recompute = [[[0, 2]] * 3 for _ in cases]  # the engine's first tokens of every chunk, say
    p, log = train_packets(model, tokenizer, cases, k_header=1, k_trailer=2, steps=25, lr=0.05, init=init,
                           bridge=True, deep=True, recompute=recompute, progress=False)
    assert p.bridge and log["deep"].shape == (model.config.num_hidden_layers, 2, model.config.hidden_size)
    assert float(log["deep"].abs().max()) > 0  # the deep parameters trained
    after = mean_loss(model, cases, p.rows, p.k_header, bridge=True)
    assert after < 0.8 * before, (before, after, log["losses"])
    llm = _llm(model, tokenizer, packets=p)
    c = cases[0]
    sc = llm.score(QUESTION, chunks=DOCS[0:3], system=SYSTEM, continuation=c.answer, return_logits=True)
    base = llm.model.embed_rows
    lay = student_layout(c.segments, c.answer, 1, 2, base, bridge=True)
    with torch.no_grad():
        ref = student_logits(model, lay.ids, lay.mask, p.rows, base, len(c.answer), positions=lay.positions)
    torch.testing.assert_close(sc.logits, ref, rtol=1e-3, atol=1e-3)
    with pytest.raises(InvalidRequestError, match="bridge"):
        train_packets(model, tokenizer, cases, k_header=1, k_trailer=1, steps=1, deep=True, progress=False)
    llm.close()
    full.close()


def test_order_mean_teacher_is_the_mean_of_full_attention_over_the_orders(tokenizer):
    """``teacher_orders=k``: the teacher's distributions are the mean over the case's order
    and k other orders (each scored by the engine's full attention on the same answer)."""
    from lazyllm.quality.floor import other_orders
    from lazyllm.quality.packet_training import build_case

    model = make_tiny("llama", seed=4)
    full = _llm(model, tokenizer, reuse="none")
    docs = DOCS[:4]
    plain = build_case(full, QUESTION, docs, SYSTEM, answer_tokens=5)
    mean = build_case(full, QUESTION, docs, SYSTEM, answer=plain.answer, teacher_orders=3, seed=7)
    assert mean.answer == plain.answer and mean.segments == plain.segments
    probs = []
    for order in [tuple(range(4)), *other_orders(4, 3, 7)]:
        sc = full.score(QUESTION, chunks=[docs[j] for j in order], system=SYSTEM, continuation=plain.answer,
                        return_logits=True)
        probs.append(torch.softmax(sc.logits.double(), -1))
    want = torch.stack(probs).mean(0).log()
    rows = len(plain.answer)  # the teacher's last rows: the answer's positions
    got = mean.teacher_logp[-rows:].double()
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)  # float16 storage of log-probs near -11
    assert (plain.teacher_logp[-rows:].double() - want).abs().max() > 0.1  # the orders differ
    full.close()
