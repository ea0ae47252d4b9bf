"""The batched sampler (``lazyllm.engine.running.sampler``) on its own: greedy rows are the argmax,
sampled rows follow softmax(logits / T) restricted to top-k and top-p (chi-square against
the probabilities computed here independently), a row's draws depend only on its seed and
token index (not on its neighbours), and token bitmasks remove exactly the tokens they
clear."""
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lazyllm.engine.running.sampler import Sampler, TokenConstraint, apply_bitmask, bitmask_words, row_uniform
from lazyllm.types import SamplingParams

# chi-square quantiles at 1 - 1e-4 by degrees of freedom (a correct sampler fails one
# configuration with probability 1e-4; the draws are seeded, so the outcome is fixed)
CHI2_9999 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88, 8: 31.83, 9: 33.72,
             10: 35.56, 11: 37.37}


_ids = itertools.count()  # rows are told apart by their request id


def _row(seed=None, generated=0, constraint=None, **params):
    return SimpleNamespace(params=SamplingParams(**params), seed=seed, constraint=constraint, id=next(_ids),
                           state=SimpleNamespace(generated=[0] * generated))


def _expected(logits: np.ndarray, temperature: float, top_k: int, top_p: float, allowed=None) -> np.ndarray:
    """The target distribution, written out in numpy: mask, temperature, top-k, then the
    smallest most-likely set whose renormalised mass reaches top_p."""
    x = logits.astype(np.float64) / temperature
    if allowed is not None:
        x = np.where(allowed, x, -np.inf)
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), dtype=bool)
    k = top_k if top_k > 0 else len(x)
    keep[order[:k]] = True
    x = np.where(keep, x, -np.inf)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1.0:
        cum = 0.0
        nucleus = np.zeros(len(x), dtype=bool)
        for i in order:
            if cum >= top_p or p[i] == 0:
                break
            nucleus[i] = True
            cum += p[i]
        p = np.where(nucleus, p, 0.0)
        p /= p.sum()
    return p


def _chi2(counts: np.ndarray, p: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    assert counts[p == 0].sum() == 0, "a token with probability 0 was drawn"
    m = p > 0
    e = n * p[m]
    return float(((counts[m] - e) ** 2 / e).sum()), int(m.sum()) - 1


LOGITS = np.array([2.0, 1.5, 1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -1.0, -2.0, 1.0], dtype=np.float32)
CONFIGS = [dict(temperature=1.0), dict(temperature=0.7, top_k=4), dict(temperature=1.3, top_p=0.6),
           dict(temperature=1.0, top_k=6, top_p=0.8), dict(temperature=2.0, top_p=0.95, mask=True)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_sampled_rows_follow_the_filtered_softmax(cfg):
    """20,000 draws per configuration (a batch of 500 rows, each its own seed, 40 tokens
    each) against the expected probabilities: chi-square below its 1 - 1e-4 quantile; the
    same draws against the unfiltered softmax fail, so the test can tell the difference."""
    cfg = dict(cfg)
    allowed = None
    cons = None
    if cfg.pop("mask", False):
        allowed = np.array([i % 3 != 1 for i in range(len(LOGITS))])
        cons = _AllowedSet(np.flatnonzero(allowed).tolist())
    V, B, steps = len(LOGITS), 500, 40
    sampler = Sampler(torch.device("cpu"))
    rows = [_row(seed=1000 + i, constraint=cons, **cfg) for i in range(B)]
    logits = torch.from_numpy(np.tile(LOGITS, (B, 1)))
    counts = np.zeros(V, dtype=np.int64)
    for t in range(steps):
        for r in rows:
            r.state.generated = [0] * t
        picks = sampler.pick(logits, rows).numpy()
        counts += np.bincount(picks, minlength=V)
    p = _expected(LOGITS, cfg.get("temperature", 1.0), cfg.get("top_k", 0), cfg.get("top_p", 1.0), allowed)
    stat, df = _chi2(counts, p)
    assert stat < CHI2_9999[df], (stat, df, counts, p)
    wrong = _expected(LOGITS, cfg.get("temperature", 1.0) * 1.5, 0, 1.0, allowed)
    m = wrong > 0
    e = counts.sum() * wrong[m]
    assert ((counts[m] - e) ** 2 / e).sum() > 10 * CHI2_9999[int(m.sum()) - 1]


def test_greedy_rows_are_the_argmax_and_draws_do_not_depend_on_the_batch():
    """A row's pick depends on its logits, seed and token index only: the same rows give the
    same tokens alone, in another order and next to greedy, top-p and masked rows; greedy
    rows are exactly ``argmax`` (first index on ties)."""
    g = torch.Generator().manual_seed(0)
    V = 300
    logits = torch.randn(6, V, generator=g) * 3
    logits[5, 7] = logits[5, 9] = logits[5].max() + 1  # a tie: argmax takes the first
    rows = [_row(seed=s, generated=s, temperature=t, top_k=k, top_p=p)
            for s, t, k, p in [(1, 1.0, 0, 1.0), (2, 0.8, 20, 1.0), (3, 1.2, 0, 0.7), (4, 0.0, 0, 1.0),
                               (5, 1.0, 5, 0.5), (6, 0.0, 0, 1.0)]]
    sampler = Sampler(torch.device("cpu"))
    together = sampler.pick(logits, rows).tolist()
    alone = [sampler.pick(logits[i:i + 1], [rows[i]]).item() for i in range(6)]
    perm = [4, 1, 5, 0, 3, 2]
    shuffled = sampler.pick(logits[perm], [rows[i] for i in perm]).tolist()
    assert together == alone == [shuffled[perm.index(i)] for i in range(6)]
    assert together[3] == int(logits[3].argmax()) and together[5] == 7
    masked = _row(seed=9, constraint=_AllowedSet([1, 2, 3]), temperature=1.0)
    with_more = sampler.pick(torch.cat([logits, logits[:1]]), rows + [masked]).tolist()
    assert with_more[:6] == together and with_more[6] in (1, 2, 3)
    # another token index, another draw; another seed, another stream
    picks = {sampler.pick(logits[:1], [_row(seed=1, generated=i, temperature=5.0)]).item() for i in range(30)}
    assert len(picks) > 10
    assert sampler.pick(logits[:1], [rows[0]]).item() == together[0]


def test_top_k_1_and_tiny_top_p_are_greedy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(8, 1000, generator=g)
    sampler = Sampler(torch.device("cpu"))
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        rows = [_row(seed=i, temperature=1.5, **kw) for i in range(8)]
        assert sampler.pick(logits, rows).tolist() == logits.argmax(-1).tolist()


def test_row_uniform_is_uniform_and_a_function_of_seed_and_index():
    u = np.array([row_uniform(s, c) for s in range(200) for c in range(100)])
    assert u.min() > 0 and u.max() < 1
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    stat, df = _chi2(counts, np.full(10, 0.1))
    assert stat < CHI2_9999[df]
    assert row_uniform(5, 3) == row_uniform(5, 3) != row_uniform(5, 4) != row_uniform(6, 3)


@pytest.mark.parametrize("V", [1, 31, 32, 33, 100, 257])
@pytest.mark.parametrize("all_rows", [False, True])
def test_apply_bitmask_matches_the_bit_layout(V, all_rows):
    """Bit j of word i allows token 32 i + j (bit 31 included: negative words); rows not
    listed are untouched; applied in place."""
    rng = np.random.default_rng(V)
    B, W = (3 if all_rows else 5), bitmask_words(V)
    allowed = rng.random((3, W * 32)) < 0.4
    allowed[:, 31::32] = True  # bit 31 set in every word: negative int32 words
    allowed[0, 5::32] = False
    words = np.zeros((3, W), dtype=np.int64)
    for j in range(32):
        words |= allowed[:, j::32].astype(np.int64) << j
    words = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    assert (words < 0).all()
    x = torch.from_numpy(rng.standard_normal((B, V)).astype(np.float32))
    before = x.clone()
    rows = torch.tensor([0, 1, 2] if all_rows else [4, 0, 2])
    out = apply_bitmask(x, words, None if all_rows else rows)
    assert out is x
    ref = before.clone()
    for j, r in enumerate(rows.tolist()):
        ref[r, ~torch.from_numpy(allowed[j, :V])] = float("-inf")
    assert torch.equal(x, ref)
    assert torch.isinf(x).sum() == (~allowed[:, :V]).sum()


class _AllowedSet:
    """Tokens from a fixed set only, forever (a TokenConstraint)."""

    def __init__(self, allowed):
        self.allowed = list(allowed)

    def fill_bitmask(self, bitmask, row):
        for t in self.allowed:
            w = bitmask[row, t // 32].item() | (1 << (t % 32))
            bitmask[row, t // 32] = w - (1 << 32) if w >= 1 << 31 else w

    def accept(self, token):
        return token in self.allowed

    def is_terminated(self):
        return False


def test_test_constraint_is_a_token_constraint():
    assert isinstance(_AllowedSet([1]), TokenConstraint)


def test_a_constraint_that_allows_nothing_or_raises_fails_only_its_row():
    class Nothing(_AllowedSet):
        def fill_bitmask(self, bitmask, row):
            pass

    class Broken(_AllowedSet):
        def fill_bitmask(self, bitmask, row):
            raise RuntimeError("grammar state lost")

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    rows = [_row(constraint=Nothing([])), _row(), _row(constraint=Broken([]))]
    sampler = Sampler(torch.device("cpu"))
    picks = sampler.pick(logits, rows).tolist()
    assert picks[1] == int(logits[1].argmax())
    failed = {id(r): str(e) for r, e in sampler.failed}
    assert set(failed) == {id(rows[0]), id(rows[2])}
    assert "allows no token" in failed[id(rows[0])] and "grammar state lost" in failed[id(rows[2])]


def test_a_class_that_fills_many_rows_at_once_is_called_once_per_pick():
    class Batched(_AllowedSet):
        calls = []

        @classmethod
        def fill_bitmasks(cls, items, bitmask):
            cls.calls.append([row for _, row in items])
            for c, row in items:
                c.fill_bitmask(bitmask, row)

    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    rows = [_row(constraint=Batched([3, 4])), _row(), _row(constraint=_AllowedSet([50])),
            _row(constraint=Batched([70, 99]))]
    picks = Sampler(torch.device("cpu")).pick(logits.clone(), rows).tolist()
    assert Batched.calls == [[0, 2]]  # the rows of the mask buffer (constrained rows only)
    assert picks[0] == 3 + int(logits[0, 4] > logits[0, 3]) and picks[2] == 50
    assert picks[3] == (99 if logits[3, 99] > logits[3, 70] else 70) and picks[1] == int(logits[1].argmax())
