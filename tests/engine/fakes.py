"""Fakes for engine component tests: no model weights, no GPU.

``FakeModel`` stands in for a ``LlamaFamilyModel`` under the real ``ModelRunner``: a token's
"KV" is its id and the position it was computed at, written to the page pool's slots; its
attention gathers the keys its page table names, checks that each key's stored position plus
its entry's delta is the logical position the table says it sits at, and that the keys a query
sees are exactly positions ``0..p`` (full attention coverage, no gap, no duplicate). Its
next token is a hash of the context tokens in position order, so an engine run must give the
tokens ``reference_generate`` computes from the plain prompt, whatever the reuse mode,
preemption or page layout.
"""
from __future__ import annotations

import queue
from types import SimpleNamespace

import torch

from lazyllm.cache.store import ChunkStore, PagePool
from lazyllm.config import EngineConfig
from lazyllm.engine.engine import Engine
from lazyllm.engine.request import Request, Segment
from lazyllm.model.attention import AttentionBackend
from lazyllm.types import Chunk, SamplingParams

VOCAB = 64
EOS = 1
_TOK, _POS = 0, 1  # the two channels of a fake key: token id, stored position


def next_token(context: list[int], avoid_eos: bool = True) -> int:
    """The fake model's next token after ``context`` (token ids in position order)."""
    h = 0
    for i, t in enumerate(context):
        h = (h * 31 + (i + 1) * (t + 7)) % 1_000_003
    t = h % VOCAB
    return t + 2 if avoid_eos and t <= EOS else t


def reference_generate(prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        t = next_token(seq)
        out.append(t)
        seq.append(t)
    return out


class FakeAttention(AttentionBackend):
    """The backend's defaults (no shared decode, no calibration); the model does its own."""

    name = "fake"
    options = None
    batch_invariant = False


class FakeModel:
    """The parts of ``LlamaFamilyModel`` the model runner, recovery and engine use."""

    def __init__(self, max_context: int = 512):
        self.device = torch.device("cpu")
        self.spec = SimpleNamespace(max_context=max_context, head_dim=2, num_heads=1, num_kv_heads=1,
                                    num_layers=1)
        self.attention = FakeAttention()
        self.graph_capturable = False
        self.inv_freqs = [torch.ones(1)]
        self.freq_index = [0]
        self.forwards: list[dict] = []  # per forward: tokens, positions (for tests that count)

    def forward(self, ids, meta, k_cache, v_cache, logits_index=None):
        flat = k_cache[0].view(-1, k_cache.shape[-1])  # one KV head: (slots, 2)
        slots = meta.slot_mapping.long()
        pos = meta.positions.long()
        flat[slots, _TOK] = ids.float()
        flat[slots, _POS] = pos.float()
        self.forwards.append({"ids": ids.tolist(), "pos": pos.tolist()})
        cu = meta.cu_seqlens_q.tolist()
        rows = range(len(ids)) if logits_index is None else logits_index.tolist()
        ps = k_cache.shape[2]
        logits = torch.zeros((len(rows), VOCAB))
        scratch = (k_cache.shape[1] - 1) * ps  # the pool's scratch page: a dead row, its token dropped
        for out_row, q in enumerate(rows):
            if scratch <= int(slots[q]) < scratch + ps:
                continue
            b = next(b for b in range(len(cu) - 1) if cu[b] <= q < cu[b + 1])
            keys = self._keys(flat, meta, b, ps)
            p = int(pos[q])
            seen = sorted((lp, t) for lp, t in keys if lp <= p)
            assert [lp for lp, _ in seen] == list(range(p + 1)), f"query at {p} sees positions {seen}"
            logits[out_row, next_token([t for _, t in seen])] = 10.0
        return logits

    @staticmethod
    def _keys(flat, meta, b: int, ps: int) -> list[tuple[int, int]]:
        """``(logical position, token)`` of every key row ``b``'s table names, each checked
        against the position its entry gives it."""
        out = []
        cols = zip(meta.block_table[b].tolist(), meta.block_pos[b].tolist(), meta.block_delta[b].tolist(),
                   meta.block_len[b].tolist())
        for page, epos, delta, n in cols:
            for i in range(n):
                tok, spos = flat[page * ps + i].tolist()
                assert int(spos) + delta == epos + i, f"page {page} slot {i}: stored {spos} + {delta} != {epos + i}"
                out.append((epos + i, int(tok)))
        return out


def fake_rerotate_copy(k, v, src, dst, delta, inv_freq):
    """The re-rotating page copy, for fake keys: the stored position moves by ``delta``."""
    k[:, dst.long()] = k[:, src.long()]
    v[:, dst.long()] = v[:, src.long()]
    k[:, dst.long(), :, :, _POS] += delta.float()[None, :, None, None]


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i == EOS))


def make_store(num_pages: int = 64, page_size: int = 4) -> ChunkStore:
    pool = PagePool(1, 1, 2, page_size=page_size, num_pages=num_pages, dtype=torch.float32, device="cpu")
    return ChunkStore(pool)


def make_engine(reuse: str = "lazy", *, num_pages: int = 64, page_size: int = 4, max_batch_size: int = 8,
                **options) -> Engine:
    """An engine over ``FakeModel`` on a CPU pool; ``options`` are ``EngineConfig`` fields."""
    store = make_store(num_pages, page_size)
    options.setdefault("max_batch_tokens", 256)
    options.setdefault("overlap_decode", False)
    # the previous default (no recompute unless asked): FakeModel has no attention-mass pass
    config = EngineConfig.resolve("isolated", reuse=reuse, device="cpu", packets=None, **options)
    return Engine(FakeModel(), FakeTokenizer(), store, config, fingerprint="fake", eos_ids={EOS},
                  max_batch_size=max_batch_size, cuda_graphs=False, rerotate_copy=fake_rerotate_copy)


def make_request(prefix: list[int], chunks: list[list[int]], suffix: list[int], *, max_new_tokens: int = 4,
                 stop: tuple[str, ...] = (), **kw) -> Request:
    from lazyllm.engine.detokenizer import Detokenizer

    segs = [Segment("prefix", list(prefix))]
    segs += [Segment("chunk", list(c), Chunk(f"chunk {c}", str(c[0]))) for c in chunks]
    segs.append(Segment("suffix", list(suffix)))
    r = Request(segments=segs, params=SamplingParams(max_new_tokens=max_new_tokens, stop=stop),
                events=queue.Queue(), **kw)
    r.detok = Detokenizer(FakeTokenizer(), stop)
    return r


def run_to_end(engine: Engine, reqs: list[Request], max_steps: int = 10_000) -> list:
    """Queue ``reqs`` and run the engine's steps on this thread until each has its result;
    the results (``GenerationOutput``) or errors, in order."""
    engine.scheduler.waiting.extend(reqs)
    out: dict[int, object] = {}
    for _ in range(max_steps):
        for r in reqs:
            while r.id not in out and not r.events.empty():
                kind, val = r.events.get()
                if kind in ("done", "error"):
                    out[r.id] = val
        if len(out) == len(reqs):
            return [out[r.id] for r in reqs]
        engine._step()
    raise AssertionError("the engine did not finish the requests")
