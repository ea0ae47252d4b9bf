"""Token picks for a batch of rows, on the logits' device: greedy, temperature, top-k, top-p,
per-row seeds and per-row token masks, in one batched pass.

Every row of a batch is picked by the same few tensor ops over ``(B, vocab)`` logits:

* token masks (``TokenConstraint``): the constrained rows' bitmasks are filled on the host,
  copied once and applied to those rows in one masked fill;
* greedy rows take the argmax (of the masked logits where the row is constrained);
* sampled rows divide by their temperature, drop what top-k and top-p leave out (as a logit
  threshold per row, taken from that row's sorted logits, so a row's filter never depends on
  another row), and draw by inverse CDF: the first token whose cumulative probability reaches
  ``u * total``.

The uniform ``u`` of a row is a hash of the request's seed and the index of the token being
drawn (``row_uniform``), computed on the host: a seeded request draws the same tokens whatever
else is in its batch, whether decode steps overlap or not, and after a preemption.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np
import torch

from ...errors import LazyLLMError
from ...intmath import cdiv
from ..pinned import PinnedTurns

__all__ = ["TokenConstraint", "Sampler", "top2_margins", "row_uniform", "bitmask_words", "apply_bitmask"]


def top2_margins(rows: torch.Tensor) -> torch.Tensor:
    """Per row of logits ``(..., vocab)``: the probability of the likeliest token minus the
    second's (float32), the signal ``escalate_below`` compares: how firmly the logits decide
    the next token (0: a tie). Two reductions (top-2, log-sum-exp), nothing the size of the
    vocabulary written, so a decode step can carry it."""
    top = rows.topk(2, dim=-1).values.float()
    p = (top - torch.logsumexp(rows.float(), dim=-1, keepdim=True)).exp()
    return p[..., 0] - p[..., 1]


@runtime_checkable
class TokenConstraint(Protocol):
    """What the engine asks of a grammar (or any rule) that restricts a request's tokens.

    The engine calls ``fill_bitmask`` before each of the request's picks, ``accept`` with the
    token picked, then ``is_terminated``: once it is true the request finishes with
    ``finish_reason == "stop"``."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed tokens into ``bitmask[row]``: ``bitmask`` is an int32 CPU tensor
        ``(rows, ceil(vocab / 32))`` (vocab: the model's logits width), bit ``j`` of word
        ``i`` allows token ``32 * i + j`` (xgrammar's and llguidance's layout). The row is
        zeroed (nothing allowed) before the call."""

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the token is not allowed."""

    def is_terminated(self) -> bool:
        """True when the structure is complete: the request must stop."""

    # Optional: a class may also define ``fill_bitmasks(items, bitmask)`` (a classmethod or
    # staticmethod; ``items``: ``(constraint, row)`` pairs of that class) to fill many rows in
    # one call, e.g. on several threads; the sampler then calls it once per step instead of
    # each row's ``fill_bitmask``.


def bitmask_words(vocab: int) -> int:
    """int32 words per row of a token bitmask over ``vocab`` tokens."""
    return cdiv(vocab, 32)


_M64 = (1 << 64) - 1


def _mix64(z: int) -> int:
    # splitmix64's finalizer: a bijection of 64-bit ints whose outputs pass BigCrush
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def row_uniform(seed: int, counter: int) -> float:
    """A uniform draw in ``(0, 1)`` (53 bits) for token ``counter`` of a request seeded with
    ``seed``: a pure function of both, so the draw does not depend on the batch."""
    z = _mix64(_mix64((seed * 0x9E3779B97F4A7C15) & _M64) ^ ((counter + 1) * 0xD1B54A32D192ED03 & _M64))
    return ((z >> 11) + 0.5) * 2.0 ** -53


_FORBIDDEN: dict = {}  # device -> (256, 8) bool: bit j of byte b is clear


def _forbidden_bits(device: torch.device) -> torch.Tensor:
    t = _FORBIDDEN.get(device)
    if t is None:
        b = torch.arange(256, dtype=torch.int32)
        t = _FORBIDDEN[device] = (((b[:, None] >> torch.arange(8, dtype=torch.int32)) & 1) == 0).to(device)
    return t


def apply_bitmask(x: torch.Tensor, words: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Set to ``-inf``, in place, the logits of ``x`` ``(B, V)`` whose tokens the bitmask
    ``words`` ``(C, ceil(V / 32))`` int32 does not allow, in rows ``rows`` ``(C,)`` (long;
    ``None``: every row, ``C == B``); returns ``x``. Rows not listed are unchanged. The bits
    are expanded through a byte table (one gather), so the mask costs about one pass over the
    masked rows."""
    V = x.shape[-1]
    C = words.shape[0]
    # little-endian words: byte k of word i holds the bits of tokens 32 i + 8 k .. + 7
    forbidden = _forbidden_bits(x.device)[words.contiguous().view(torch.uint8).long()].view(C, -1)[:, :V]
    if rows is None:
        return x.masked_fill_(forbidden, float("-inf"))
    return x.index_copy_(0, rows, x.index_select(0, rows).masked_fill_(forbidden, float("-inf")))


class Sampler:
    """Batched token picks (engine thread only).

    ``pick(logits, rows)`` takes ``(B, V)`` logits on any device and one ``Request`` (or
    ``None``: a row whose token is thrown away) per row, and returns the ``(B,)`` long picks
    on the same device, without waiting for them: the host fills the constrained rows'
    masks and the sampling parameters, sends them in two copies, and enqueues the ops.
    Rows whose constraint failed (raised, or allowed no token) are picked as greedy and
    listed in ``failed`` (request to error) until the next ``pick``."""

    def __init__(self, device: torch.device):
        self.device = device
        self._params = PinnedTurns(device, torch.float64)
        self._masks = PinnedTurns(device, torch.int32)
        self.failed: list[tuple] = []  # (request, error)

    @staticmethod
    def plain_greedy(rows: list) -> bool:
        """True when every row is greedy and unconstrained: its argmax is its pick."""
        return all(r is None or (r.params.greedy and r.constraint is None) for r in rows)

    @torch.inference_mode()  # the forward's logits are inference tensors, masked in place
    def pick(self, logits: torch.Tensor, rows: list) -> torch.Tensor:
        """``(B,)`` long picks of ``logits`` ``(B, V)``, one per row of ``rows``; each live row
        draws token number ``len(r.state.generated)`` of its request. The constrained rows of
        ``logits`` (float32) are masked in place."""
        self.failed = []
        B, V = logits.shape
        x = logits if logits.dtype == torch.float32 else logits.float()
        cons = [(i, r) for i, r in enumerate(rows) if r is not None and r.constraint is not None]
        if cons:  # in place: a step's logits are read by nothing after its pick
            self._mask(x, cons, V)
        failed = {r.id for r, _ in self.failed}
        live = [r is not None and not r.params.greedy and r.id not in failed for r in rows]
        if not any(live):
            return x.argmax(dim=-1)
        k = self._params.take(5 * B)
        buf = self._params.bufs[k][:5 * B]
        h = buf.view(5, B).numpy()
        # temperature, top-k, top-p, u, sampled; greedy rows get values that change nothing
        h[0], h[1], h[2], h[3], h[4] = 1.0, V, 1.0, 0.5, 0.0
        widths = []  # the filtering rows' top-k (V: top-p alone)
        for i, r in enumerate(rows):
            if not live[i]:
                continue
            p = r.params
            h[0, i] = p.temperature
            if 0 < p.top_k < V:
                h[1, i] = p.top_k
            h[2, i] = p.top_p
            h[3, i] = row_uniform(r.seed, len(r.state.generated))
            h[4, i] = 1.0
            if 0 < p.top_k < V or p.top_p < 1.0:
                widths.append(p.top_k if 0 < p.top_k < V else V)
        dev = self._params.send(k, buf).view(5, B)
        sampled = _sample(x, dev[0].float(), dev[1].long(), dev[2].float(), dev[3], max(widths, default=0))
        if all(live):
            return sampled
        return torch.where(dev[4] > 0, sampled, x.argmax(dim=-1))

    def _mask(self, x: torch.Tensor, cons: list, V: int) -> None:
        """Apply the constrained rows' masks to ``x`` in place (one copy, one masked fill)."""
        W = bitmask_words(V)
        n = len(cons) * W + len(cons)
        k = self._masks.take(n)
        h = self._masks.bufs[k][:n]
        words = h[:len(cons) * W].view(len(cons), W)
        words.zero_()
        errors: dict[int, Exception] = {}
        groups: dict[type, list] = {}  # constraint classes that fill many rows in one call
        for j, (_, r) in enumerate(cons):
            if hasattr(type(r.constraint), "fill_bitmasks"):
                groups.setdefault(type(r.constraint), []).append(j)
                continue
            try:
                r.constraint.fill_bitmask(words, j)
            except Exception as e:  # this request fails; the batch goes on
                errors[j] = e
        for cls, js in groups.items():
            try:
                cls.fill_bitmasks([(cons[j][1].constraint, j) for j in js], words)
            except Exception as e:
                errors.update((j, e) for j in js)
        empty = (words == 0).all(dim=1).tolist()
        for j, (_, r) in enumerate(cons):
            e = errors.get(j) or (LazyLLMError("the token constraint allows no token at this point")
                                  if empty[j] else None)
            if e is not None:
                self.failed.append((r, e if isinstance(e, LazyLLMError) else
                                    LazyLLMError(f"token constraint failed: {e!r}")))
                words[j] = -1
        h[len(cons) * W:] = torch.from_numpy(np.asarray([i for i, _ in cons], dtype=np.int32))
        dev = self._masks.send(k, h)
        words = dev[:len(cons) * W].view(len(cons), W)
        apply_bitmask(x, words, None if len(cons) == x.shape[0] else dev[len(cons) * W:].long())


def _sample(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            u: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse-CDF draws ``(B,)`` from ``softmax(x / temperature)`` restricted to each row's
    top-k tokens and then its top-p nucleus (the smallest set of most likely tokens whose mass
    reaches ``top_p``; ties at the edge kept). ``x`` ``(B, V)`` float32 logits (``-inf``:
    masked), ``temperature``, ``top_p`` ``(B,)`` float32, ``top_k`` ``(B,)`` long (``V``: off),
    ``u`` ``(B,)`` float64 in ``(0, 1)``. ``width``: how many of each row's largest logits
    the filters look at: 0 when no row filters, the largest top-k when every filtering row
    has one, else ``V`` (a full sort). No host synchronisation.

    Each row's result depends on its own values only, whatever ``width`` and the other rows:
    the filters' threshold is one of its sorted logits, and their masses are prefix sums
    normalised by a prefix sum (no reduction whose order could change with the width)."""
    B, V = x.shape
    z = x / temperature[:, None]
    if width:
        vals = (torch.topk(z, width, dim=-1) if width < V else torch.sort(z, dim=-1, descending=True)).values
        k = top_k.clamp(max=width)
        e = torch.exp(vals - vals[:, :1]).masked_fill_(torch.arange(width, device=x.device) >= k[:, None], 0.0)
        cum = torch.cumsum(e, dim=-1)
        total = cum.gather(1, (k - 1)[:, None])
        # the nucleus: the tokens with less than top_p of the (top-k) mass before them
        n_p = ((cum - e) <= top_p[:, None] * total).sum(dim=-1)
        n = torch.where(top_p < 1.0, torch.minimum(n_p, k), k).clamp(min=1)
        thr = vals.gather(1, (n - 1)[:, None])
        thr = thr.masked_fill(((top_k >= V) & (top_p >= 1.0))[:, None], float("-inf"))
        z = z.masked_fill(z < thr, float("-inf"))
    cdf = torch.cumsum(torch.softmax(z, dim=-1), dim=-1, dtype=torch.float64)
    # the first token whose cumulative mass reaches u * total (it has a mass > 0: u > 0)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].contiguous())[:, 0]
    return pick.clamp(max=V - 1)
