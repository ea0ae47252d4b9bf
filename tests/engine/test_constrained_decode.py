"""Token constraints in the engine (``Request.constraint``, a ``TokenConstraint``) with the tiny
model on CPU: constrained rows batched with unconstrained ones, greedy and sampled, one step at
a time and overlapped. A constrained row never emits a token its mask clears; a greedy
constrained row takes the best allowed token of the model's own logits; a constraint that
completes stops its request; a failing constraint fails only its request; unconstrained rows
are unchanged by their constrained neighbours."""
import pytest
import torch

from lazyllm import LazyLLM, LazyLLMError
from tests.conftest import make_tiny
from tests.engine.test_concurrency import DOCS


class AllowedSet:
    """Tokens from a fixed set only; complete after ``length`` tokens (never if None)."""

    def __init__(self, allowed, length=None):
        self.allowed, self.length, self.seen = sorted(allowed), length, []

    def fill_bitmask(self, bitmask, row):
        w = torch.zeros(bitmask.shape[1] * 32, dtype=torch.bool)
        w[self.allowed] = True
        bits = (w.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(dim=1)
        bitmask[row] = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)

    def accept(self, token):
        self.seen.append(token)
        return token in self.allowed

    def is_terminated(self):
        return self.length is not None and len(self.seen) >= self.length


class FixedSequence(AllowedSet):
    """Exactly ``seq``, then complete."""

    def __init__(self, seq):
        super().__init__([], len(seq))
        self.seq = list(seq)

    def fill_bitmask(self, bitmask, row):
        self.allowed = [self.seq[len(self.seen)]]
        super().fill_bitmask(bitmask, row)


@pytest.fixture(scope="module")
def model():
    return make_tiny("llama", seed=5)


def _llm(model, tokenizer, overlap):
    llm = LazyLLM(model=model, tokenizer=tokenizer, overlap_decode=overlap, kv_cache_bytes=32 << 20, quality="isolated")
    llm.engine.output.eos_ids = set()  # random weights: every request runs to its length or its constraint
    return llm


def _run(llm, specs):
    """Run ``(generate kwargs, constraint)`` pairs admitted in one engine step (one batch)."""
    reqs = []
    for kw, cons in specs:
        kw = dict(kw)
        r = llm.inputs.generation(kw.pop("question"), kw.pop("chunks", None), None, **kw)
        r.streaming, r.constraint = False, cons
        reqs.append(r)
    llm.engine.call(lambda: llm.engine.scheduler.waiting.extend(reqs))
    out = []
    for r in reqs:
        try:
            out.append(llm._wait(r))
        except LazyLLMError as e:
            out.append(e)
    return out


def _clean(llm):
    s = llm.cache_stats()
    cached = sum(len(e.pages) for e in llm.store.entries.values())
    assert s["pinned_entries"] == 0 and not llm.engine.decode_state.rows
    assert s["free_pages"] + cached == s["pool_pages"]


@pytest.mark.parametrize("overlap", [False, True])
def test_constrained_rows_batched_with_free_ones(model, tokenizer, overlap):
    llm = _llm(model, tokenizer, overlap)
    q = [dict(question=f"question {i}?", chunks=DOCS[i:i + 2], max_new_tokens=12) for i in range(4)]
    free = [llm.generate(**kw).token_ids for kw in q]
    banned = {t for ids in free for t in ids}
    allowed = [t for t in range(100, 4000, 7) if t not in banned]
    seq = [17, 901, 17, 3333, 5]
    specs = [(q[0], None), (q[1], AllowedSet(allowed)), (q[2], None), (dict(q[3], temperature=1.1, seed=4), None),
             (dict(q[1], temperature=1.4, seed=7), AllowedSet(allowed[:40])), (q[2], FixedSequence(seq)),
             (dict(q[0], max_new_tokens=30), AllowedSet(allowed, length=6))]
    m = llm.engine.metrics
    steps, tokens = m["decode_steps"], m["decode_tokens"]
    outs = _run(llm, specs)
    # one batch: 11 steps after the prefill for the longest (12 tokens; overlapped, no step
    # after the one whose tokens end every row), 64 decoded tokens (overlapped, 2 more: the
    # tokens after the stop of the two requests that stop early, dropped)
    assert (m["decode_steps"] - steps, m["decode_tokens"] - tokens) == ((11, 66) if overlap else (11, 64))
    assert outs[0].token_ids == free[0] and outs[2].token_ids == free[2]  # neighbours unchanged
    assert set(outs[1].token_ids) <= set(allowed) and len(outs[1].token_ids) == 12
    assert set(outs[4].token_ids) <= set(allowed[:40]) and len(set(outs[4].token_ids)) > 1
    assert outs[5].token_ids == seq and outs[5].finish_reason == "stop"
    assert len(outs[6].token_ids) == 6 and outs[6].finish_reason == "stop"
    assert specs[1][1].seen == outs[1].token_ids  # accept() saw every token, in order
    # greedy under a mask is the best allowed token of the model's own logits
    sc = llm.score(q[1]["question"], chunks=q[1]["chunks"], continuation=outs[1].token_ids, return_logits=True)
    best = sc.logits[:, allowed].argmax(dim=-1)
    assert [allowed[i] for i in best.tolist()] == outs[1].token_ids
    if overlap:
        assert llm.engine.metrics["overlapped_steps"] > 0
    # seeded sampled rows (constrained or not) draw the same tokens in another batch
    again = _run(llm, [specs[4], (q[3], None), specs[3]])
    assert again[0].token_ids == outs[4].token_ids and again[2].token_ids == outs[3].token_ids
    _clean(llm)
    llm.close()


def test_overlap_gives_the_same_tokens_for_sampled_and_constrained_batches(model, tokenizer):
    """Sampled and constrained rows now overlap their decode steps, with the same tokens as
    one step at a time."""
    specs = lambda: [  # noqa: E731 (fresh constraint objects per engine)
        (dict(question="a?", chunks=DOCS[:2], max_new_tokens=16, temperature=0.9, seed=1, top_p=0.9), None),
        (dict(question="b?", chunks=DOCS[2:4], max_new_tokens=10, temperature=1.2, seed=2, top_k=50),
         AllowedSet(range(200, 900))),
        (dict(question="c?", chunks=DOCS[1:3], max_new_tokens=14), AllowedSet(range(3000, 3100), length=9)),
        (dict(question="d?", max_new_tokens=7, temperature=0.8, seed=3), None)]
    got = {}
    for overlap in (False, True):
        llm = _llm(model, tokenizer, overlap)
        got[overlap] = [(o.token_ids, o.finish_reason) for o in _run(llm, specs())]
        assert (llm.engine.metrics["overlapped_steps"] > 0) == overlap
        _clean(llm)
        llm.close()
    assert got[True] == got[False]
    assert [len(t) for t, _ in got[True]] == [16, 10, 9, 7]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failing_constraint_fails_only_its_request(model, tokenizer, overlap):
    class RejectsThird(AllowedSet):
        def accept(self, token):
            return super().accept(token) and len(self.seen) < 3

    class EmptyAfterTwo(AllowedSet):
        def fill_bitmask(self, bitmask, row):
            if len(self.seen) < 2:
                super().fill_bitmask(bitmask, row)

    class Raises(AllowedSet):
        def fill_bitmask(self, bitmask, row):
            raise KeyError("no state")

    llm = _llm(model, tokenizer, overlap)
    kw = dict(question="q?", chunks=DOCS[:2], max_new_tokens=8)
    ref = llm.generate(**kw).token_ids
    outs = _run(llm, [(kw, RejectsThird(range(50, 5000))), (kw, None), (kw, EmptyAfterTwo(range(50, 5000))),
                      (kw, Raises([1]))])
    assert isinstance(outs[0], LazyLLMError) and "rejected" in str(outs[0])
    assert isinstance(outs[2], LazyLLMError) and "allows no token" in str(outs[2])
    assert isinstance(outs[3], LazyLLMError) and "no state" in str(outs[3])
    assert outs[1].token_ids == ref
    _clean(llm)
    assert llm.generate(**kw).token_ids == ref  # the engine goes on
    llm.close()
