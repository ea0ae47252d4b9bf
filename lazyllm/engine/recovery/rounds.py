"""Quality recovery's selection for a whole admission round (``Recovery.apply_round``).

Selecting per request costs each request a question pass (a forward of its question over its
cached KV), a key probe and a read of its picks from the device: under load, a round of many
requests paid for many small forwards, each bound by reading the weights, and waited for the
device once per request. Here the round's requests share each of those: one question pass
over all their questions (each over its own table), one layer-``probe_layer`` key probe per
``max_batch_tokens`` of shortlisted tokens, and a single read of every pick. The scores, the
shortlist and the final pick are each request's own (a row each, padded), so the picks are
the ones ``Recovery._pick`` makes for the request alone.

The engine's three selections batch (``deviation``, ``attention``, ``two-stage``: the
``batched`` attribute of their registered scorer); a selection registered by a user runs per
request.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lazyllm.kernels.reference import rotate_by_delta

from ...config import selection as scorer_of
from ..pinned import to_device
from ..request import Request, slot_of
from ..running.model_runner import budget_groups
from .chunk_index import DELTA, DEVICE_ROWS, PAGE, PROBE, ROW, SLOT, TOKEN


def batched_selection(name: str) -> str | None:
    """The batched form of the selection ``name`` (``"deviation"``, ``"attention"`` or
    ``"two-stage"``), or ``None`` where it has none (a selection a user registered)."""
    return getattr(scorer_of(name), "batched", None)


def batches(rec) -> bool:
    """Whether ``rec``'s selection can run for a whole round: one of the engine's own, with
    its key probe (where it has one) at layer 1 over the cached layer-0 K/V (deeper probes
    run each prompt head densely, request by request)."""
    mode = batched_selection(rec.selection)
    if mode is None or rec.ratio <= 0:
        return False
    return mode == "attention" or (rec.probe_layer == 1 and hasattr(rec.model, "probe_keys_paged"))


@dataclass
class _Round:
    """The round's requests that select (``n_pick`` > 0), their chunk token indexes as one
    device tensor, and each one's row of the padded score matrices."""
    reqs: list[Request]
    n_pick: np.ndarray  # (B,) tokens each request picks
    n_ok: np.ndarray  # (B,) its chunk tokens that may be picked (not at home)
    offs: np.ndarray  # (B + 1,) its first token in the concatenated index
    excluded: np.ndarray  # (sum N,) bool: at home, never picked
    dev: torch.Tensor  # (DEVICE_ROWS, sum N) int64: the device rows of the requests' ``ChunkIndex``es
    width: int  # N max: the padded rows' width

    @property
    def pad(self) -> np.ndarray:
        """(sum N,) each token's place in the padded ``(B, width)`` matrix, flattened."""
        n = np.diff(self.offs)
        return np.repeat(np.arange(len(n)) * self.width - self.offs[:-1], n) + np.arange(self.offs[-1])


def select_round(rec, reqs: list[Request]) -> dict[int, np.ndarray]:
    """Each request's picks (chunk order indices, by request id), for the requests of one
    round; those that pick nothing are left out. ``rec``: the engine's ``Recovery``."""
    mode = batched_selection(rec.selection)
    rnd = _gather(rec, reqs)
    if rnd is None:
        return {}
    if mode == "deviation":  # every token that may be picked is probed
        ok = np.flatnonzero(~rnd.excluded)
        dev = _deviation(rec, rnd, to_device(torch.from_numpy(ok), rnd.dev.device), rnd.n_ok)
        return _read_picks(rnd, _padded(rnd, ok, dev), None)
    mass = _question_mass(rec, rnd)
    if mode == "two-stage":
        return _read_picks(rnd, *_two_stage(rec, rnd, mass))
    return _read_picks(rnd, mass, None)


def _gather(rec, reqs: list[Request]) -> _Round | None:
    """The round's requests that pick tokens, with their indexes concatenated and sent to the
    device in one copy."""
    sel, picks, oks, excl, hosts = [], [], [], [], []
    for r in reqs:
        home, lens, n_pick = rec.budget(r)
        if n_pick <= 0:
            continue
        sel.append(r)
        picks.append(n_pick)
        oks.append(int(lens[~home].sum()))
        excl.append(np.repeat(home, lens))
        hosts.append(rec.index(r).host)
    if not sel:
        return None
    n = np.array([h.shape[1] for h in hosts], dtype=np.int64)
    host = np.concatenate(hosts, axis=1)
    dev = to_device(torch.from_numpy(host[:DEVICE_ROWS]), rec.pool.k.device)
    return _Round(sel, np.array(picks, dtype=np.int64), np.array(oks, dtype=np.int64),
                  np.concatenate([[0], np.cumsum(n)]), np.concatenate(excl), dev, int(n.max()))


def question_ids(r: Request) -> list[int]:
    """The suffix tokens whose attention picks what a request recomputes: its suffix, less a
    score's continuation (a score recomputes what a generation of its tokens would; the
    selection never sees the answer it is scored on)."""
    ids = r.plan.suffix_ids
    if r.score is not None:
        ids = ids[:max(1, len(ids) - (len(r.score.ids) - 1))]
    return list(ids)


def _question_mass(rec, rnd: _Round) -> torch.Tensor:
    """``(B, width)``: each request's question attention per chunk token (``question_attention``),
    -inf where excluded or padded; the questions run together, ``max_batch_tokens`` a pass."""
    ps = rec.pool.page_size
    flat = []
    questions = [question_ids(r) for r in rnd.reqs]
    for group in budget_groups([len(q) for q in questions], rec.runner.max_batch_tokens):
        ids, pos, slots, cu, tables, probe_slots = [], [], [], [0], [], []
        for i in group:
            r = rnd.reqs[i]
            plan = r.plan
            S, pos0 = len(questions[i]), plan.suffix_pos
            ids += questions[i]
            pos += range(pos0, pos0 + S)
            slots += [slot_of(plan.own, j, ps) for j in range(S)]
            cu.append(cu[-1] + S)
            tables.append(rec.cached_table(r) + rec.planner.own_table(plan.own, pos0, S))
            probe_slots.append(rec.index(r).host[PROBE])
        W = max(len(t) for t in tables)
        ids_t, _, meta = rec.runner.metadata(ids, pos, slots, cu, tables, max(np.diff(cu)), [])
        rec.metrics.prefill_tokens += cu[-1]
        mass = rec.model.attention_mass(ids_t, meta, rec.pool.k, rec.pool.v, layers=rec.mass_layers)
        at = np.concatenate([p + b * W * ps for b, p in enumerate(probe_slots)])
        flat.append(mass.reshape(-1)[to_device(torch.from_numpy(at), mass.device)].float())
    return _padded(rnd, np.arange(rnd.offs[-1]), torch.cat(flat))


def _padded(rnd: _Round, which: np.ndarray, values: torch.Tensor) -> torch.Tensor:
    """``(B, width)`` scores: ``values`` at the tokens ``which`` (host indices into the
    concatenated index), -inf elsewhere and wherever a token is excluded."""
    dev = values.device
    v = values.masked_fill(to_device(torch.from_numpy(rnd.excluded[which]), dev), float("-inf"))
    out = torch.full((len(rnd.reqs) * rnd.width,), float("-inf"), device=dev)
    out[to_device(torch.from_numpy(rnd.pad[which]), dev)] = v
    return out.view(len(rnd.reqs), rnd.width)


def _deviation(rec, rnd: _Round, g: torch.Tensor, per_req: np.ndarray) -> torch.Tensor:
    """Key deviation (``Recovery.key_deviation``) of the tokens ``g`` (device indices into
    the concatenated index, by request then position, ``per_req`` of them per request),
    probed together, ``max_batch_tokens`` tokens a pass."""
    d = rnd.dev
    layer = rec.probe_layer
    full = []
    starts = np.concatenate([[0], np.cumsum(per_req)])
    for group in budget_groups(per_req.tolist(), rec.runner.max_batch_tokens):
        counts = per_req[group]
        a, b = int(starts[group[0]]), int(starts[group[-1] + 1])
        if a == b:
            continue
        cu = np.concatenate([[0], np.cumsum(counts)])
        tables = [rec.cached_table(rnd.reqs[i]) for i in group]
        zeros = np.zeros(b - a, dtype=np.int64)
        slots = np.full(b - a, rec.pool.scratch_page * rec.pool.page_size, dtype=np.int64)
        _, _, meta = rec.runner.metadata(zeros, zeros, slots, cu, tables, int(counts.max()), [])
        meta.positions = d[ROW][g[a:b]].to(torch.int32)  # already on the device
        full.append(rec.model.probe_keys_paged(d[TOKEN][g[a:b]], meta, rec.pool.k, rec.pool.v, layer))
    full = torch.cat(full)
    cached = rec.pool.k[layer][d[PAGE][g], d[SLOT][g]]
    cached = rotate_by_delta(cached, d[DELTA][g], rec.model.inv_freqs[rec.model.freq_index[layer]])
    return (full.float() - cached.float()).pow(2).sum(dim=(-1, -2)).sqrt()


def _two_stage(rec, rnd: _Round, mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ProphetKV's ranking (``Recovery.two_stage``) for every row of ``mass`` at once: each
    row's ``2 * n_pick`` highest question attention shortlist, scored by attention times key
    deviation, each scaled to its row's maximum. Returns the ``(B, K)`` scores of the
    shortlists (-inf past a row's own) and their tokens (row-local chunk order indices)."""
    dev_ = mass.device
    kc = np.minimum(rnd.n_ok, 2 * rnd.n_pick)  # each row's shortlist
    B, K = len(rnd.reqs), int(kc.max())
    idx = torch.topk(mass, K, dim=1).indices
    valid = torch.arange(K, device=dev_)[None, :] < to_device(torch.from_numpy(kc), dev_)[:, None]
    cand = torch.where(valid, idx, rnd.width).sort(dim=1).values  # by position: the probe's query order
    at = to_device(torch.from_numpy(np.concatenate([b * K + np.arange(k) for b, k in enumerate(kc)])), dev_)
    rows = to_device(torch.from_numpy(np.repeat(np.arange(B), kc)), dev_)
    local = cand.reshape(-1)[at]  # the shortlisted tokens, by row then position
    glob = local + to_device(torch.from_numpy(np.repeat(rnd.offs[:-1], kc)), dev_)
    m = torch.zeros(B * K, device=dev_)
    d = torch.zeros_like(m)
    m[at] = mass[rows, local]
    d[at] = _deviation(rec, rnd, glob, kc).to(dev_)
    m, d = m.view(B, K), d.view(B, K)
    score = (m / m.amax(1, keepdim=True).clamp_min(1e-30)) * (d / d.amax(1, keepdim=True).clamp_min(1e-30))
    return score.masked_fill(~valid, float("-inf")), cand


def _read_picks(rnd: _Round, scores: torch.Tensor, cand: torch.Tensor | None) -> dict[int, np.ndarray]:
    """Each row's ``n_pick`` highest finite scores (``cand``: the tokens of ``scores``'
    columns; ``None``: the columns are the tokens), read from the device in one copy."""
    P = int(rnd.n_pick.max())
    top = torch.topk(scores, P, dim=1)
    tok = top.indices if cand is None else cand.gather(1, top.indices)
    ok = torch.isfinite(top.values) & (torch.arange(P, device=scores.device)[None, :] < to_device(
        torch.from_numpy(rnd.n_pick), scores.device)[:, None])
    both = torch.stack([tok, ok.long()]).cpu().numpy()
    return {r.id: both[0, b][both[1, b] == 1] for b, r in enumerate(rnd.reqs)}
