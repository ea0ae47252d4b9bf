"""Training learned chunk packets by self-distillation (docs/design.md, "Learned chunk
packets"), with no labels.

The teacher is the model itself with full attention over the concatenated documents; the
student is the same frozen model reading isolated chunks, each wrapped in the packet's header
and trailer embeddings. The loss is KL(teacher || student) over the next-token distributions
of the question's and the answer's tokens, teacher-forced on the teacher's greedy answer.
Gradients reach only the packet embeddings.

The engine's paged forward is not differentiable, so the student runs the transformers model
with ``inputs_embeds`` (the packet rows put in at the virtual ids), the request's 4-D mask and
explicit position ids: for ``chunk_context="isolated"`` that is exactly what the engine computes
(the tests hold the two together).
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import InvalidRequestError
from ..model.identity import model_id
from ..model.packets import Packets

__all__ = ["TrainCase", "StudentLayout", "embed_with_packets", "student_layout", "student_mask", "student_logits",
           "build_case",
           "build_cases", "init_packets", "train_packets", "case_loss", "mean_loss"]


@dataclass
class TrainCase:
    """One distillation example.

    segments : ``[(kind, ids)]`` of the request without packets (prefix, chunks, suffix).
    answer : the teacher's greedy answer, token ids.
    teacher_logp : ``(len(suffix) + len(answer) - 1, vocab)`` float16 log-probabilities of
        full attention at the question's and answer's positions (each predicts the next token).
    docs : the documents' texts (for the split by document).
    """

    segments: list[tuple[str, list[int]]]
    answer: list[int]
    teacher_logp: torch.Tensor
    docs: list[str] = field(default_factory=list)


def embed_with_packets(hf_model, ids: torch.Tensor, rows: torch.Tensor | None, base: int) -> torch.Tensor:
    """Input embeddings ``(1, n, hidden)`` of token ids ``(n,)`` where ids ``>= base`` are packet
    rows ``rows[id - base]`` (differentiable in ``rows``), scaled like the model's own
    embeddings (Gemma multiplies by ``sqrt(hidden)``)."""
    emb = hf_model.get_input_embeddings()
    h = emb(ids.clamp(max=base - 1))
    if rows is None or rows.shape[0] == 0:
        return h[None]
    scale = getattr(emb, "embed_scale", None)
    p = rows.to(h.dtype)
    if scale is not None:
        p = p * scale.to(h.dtype)
    virtual = ids >= base
    pk = F.embedding((ids - base).clamp(0, rows.shape[0] - 1), p)
    return torch.where(virtual[:, None], pk, h)[None]


def student_mask(segments: Sequence[tuple[str, Sequence[int]]], n_extra: int, k_header: int,
                 question_sees_header: bool = True) -> torch.Tensor:
    """Boolean ``(n, n)`` mask (True = may attend) of isolated chunks with packets: a chunk
    token (packet tokens included) attends causally within its own chunk, everything else
    causally to all; ``n_extra`` answer tokens follow the suffix. With
    ``question_sees_header=False`` the suffix and answer do not attend to the headers."""
    kinds, seg_of, head = [], [], []
    for si, (kind, ids) in enumerate(segments):
        kinds += [kind] * len(ids)
        seg_of += [si] * len(ids)
        head += [kind == "chunk" and i < k_header for i in range(len(ids))]
    kinds += ["suffix"] * n_extra
    seg_of += [len(segments) - 1] * n_extra
    head += [False] * n_extra
    n = len(kinds)
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    seg = torch.tensor(seg_of)
    is_chunk = torch.tensor([k == "chunk" for k in kinds])
    allowed = torch.where(is_chunk[:, None], seg[:, None] == seg[None, :], torch.ones(n, n, dtype=torch.bool))
    if not question_sees_header:
        is_q = torch.tensor([k == "suffix" for k in kinds])
        allowed &= ~(is_q[:, None] & torch.tensor(head)[None, :])
    return causal & allowed


@dataclass
class StudentLayout:
    """The student's input for one case: isolated chunks with packets, some chunk tokens
    recomputed per request (bridges, a recovery selection), then the question and answer.

    A recomputed token appears twice, as the engine holds it: its cached, isolated copy in
    its chunk (which the chunk's later tokens read, as they read the cache) and a
    recomputed copy at the same position, placed after the chunks, that attends to
    everything before its position (the prefix, the other chunks' cached tokens, the
    earlier recomputed copies); the question and the answer read the recomputed copy
    instead of the cached one. So no cached token ever reads a request-time state.

    ids, positions : ``(n,)`` long; mask : ``(n, n)`` bool (True = may attend);
    bridge_rows : ``(n,)`` bool, the recomputed copies of bridge tokens (where deep bridge
    parameters are added); chunk_rows : ``(n,)`` bool, the cached chunk tokens. The
    question's and answer's rows are the last ones.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    bridge_rows: torch.Tensor
    chunk_rows: torch.Tensor


def student_layout(segments: Sequence[tuple[str, Sequence[int]]], answer: Sequence[int], k_header: int,
                   k_trailer: int, base: int, *, bridge: bool = False,
                   recompute: Sequence[Sequence[int]] | None = None,
                   question_sees_header: bool = True) -> StudentLayout:
    """``StudentLayout`` of a case whose ``segments`` ``[(kind, ids)]`` have no packets yet
    (each chunk gets ``k_header`` + ``k_trailer`` virtual ids from ``base``), followed by the
    teacher-forced ``answer[:-1]``. ``bridge``: the trailer is recomputed per request.
    ``recompute``: per chunk, the indices (in the chunk's ids with its packet) recomputed
    per request as well."""
    head = list(range(base, base + k_header))
    tail = list(range(base + k_header, base + k_header + k_trailer))
    # per row: id, position, kind (0 prefix, 1 cached chunk token, 2 recomputed copy, 3
    # question/answer), chunk (-1 outside), a packet header, a cached token with a recomputed
    # copy (on copies: a bridge copy, read below)
    rows: list[tuple[int, int, int, int, bool, bool]] = []
    copies: list[tuple[int, int, bool]] = []  # (id, position, is bridge)
    p = 0
    ci = 0
    for k, s in segments:
        if k == "chunk":
            toks = head + list(s) + tail
            again = set(recompute[ci]) if recompute is not None else set()
            if bridge:
                again |= set(range(len(toks) - k_trailer, len(toks)))
            for i, t in enumerate(toks):
                rows.append((t, p + i, 1, ci, i < k_header, i in again))
                if i in again:
                    copies.append((t, p + i, bridge and i >= len(toks) - k_trailer))
            ci += 1
            p += len(toks)
        else:
            tail_kind = 0 if k == "prefix" else 3
            if tail_kind == 3 and copies:
                rows += [(t, q, 2, -1, False, b) for t, q, b in copies]
                copies = []
            rows += [(t, p + i, tail_kind, -1, False, False) for i, t in enumerate(s)]
            p += len(s)
    rows += [(t, p + i, 3, -1, False, False) for i, t in enumerate(answer[:-1])]
    ids, pos, kind, chunk_of, is_head, redone = zip(*rows) if rows else ((),) * 6
    kd, P, C = torch.tensor(kind, dtype=torch.long), torch.tensor(pos, dtype=torch.long), \
        torch.tensor(chunk_of, dtype=torch.long)
    R, H = torch.tensor(redone, dtype=torch.bool), torch.tensor(is_head, dtype=torch.bool)
    mask = _student_mask(kd, P, C, R, H, question_sees_header)
    return StudentLayout(torch.tensor(ids, dtype=torch.long), P, mask, (kd == 2) & R, kd == 1)


def _student_mask(kd: torch.Tensor, P: torch.Tensor, C: torch.Tensor, R: torch.Tensor, H: torch.Tensor,
                  question_sees_header: bool) -> torch.Tensor:
    """Which row reads which (``student_layout``'s rows: kinds ``kd``, positions ``P``, chunks
    ``C``, recomputed ``R``, packet headers ``H``): the prefix and each cached chunk causally
    within themselves, recomputed copies over what a request reads, the question and answer
    over all of it."""
    cached = (kd == 1)
    readable = (kd == 0) | (cached & ~R) | (kd == 2) | (kd == 3)  # what request-time rows read
    before_eq = P[None, :] <= P[:, None]
    before = P[None, :] < P[:, None]
    mask = torch.zeros(len(kd), len(kd), dtype=torch.bool)
    rows_prefix = (kd == 0)[:, None]
    mask |= rows_prefix & (kd == 0)[None, :] & before_eq
    mask |= cached[:, None] & cached[None, :] & (C[:, None] == C[None, :]) & before_eq
    copy_rows = (kd == 2)[:, None]
    mask |= copy_rows & ((readable & (kd != 2))[None, :] & before | (kd == 2)[None, :] & before_eq)
    q_rows = (kd == 3)[:, None]
    q_cols = readable
    if not question_sees_header:
        q_cols = q_cols & ~(cached & H)
    mask |= q_rows & q_cols[None, :] & before_eq
    return mask


def student_logits(hf_model, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None, base: int,
                   last: int, *, positions: torch.Tensor | None = None, deep: torch.Tensor | None = None,
                   deep_rows: torch.Tensor | None = None, k_header: int = 0) -> torch.Tensor:
    """Float32 logits ``(last, vocab)`` of the final ``last`` positions of ``ids`` ``(n,)`` under
    the boolean ``(n, n)`` ``mask`` at ``positions`` (default ``0..n-1``); differentiable in
    ``rows`` and ``deep``. ``deep``: ``(layers, k_trailer, hidden)`` added to the output of
    every decoder layer at the ``deep_rows`` (``(n,)`` bool: bridge tokens), trailer row
    ``id - base - k_header`` each."""
    dev = ids.device
    n = ids.shape[0]
    pos = positions if positions is not None else torch.arange(n, device=dev)
    hooks = []
    if deep is not None and deep_rows is not None and bool(deep_rows.any()):
        where = deep_rows.to(dev).nonzero().squeeze(1)
        which = (ids[where] - base - k_header).to(dev)
        for li, layer in enumerate(hf_model.model.layers):
            hooks.append(layer.register_forward_hook(_add_at(where, deep[li][which])))
    try:
        out = hf_model.model(inputs_embeds=embed_with_packets(hf_model, ids, rows, base),
                             attention_mask=mask[None, None].to(dev), position_ids=pos.to(dev)[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    h = out.last_hidden_state[0, n - last:]
    return hf_model.lm_head(h).float()


def _add_at(where: torch.Tensor, delta: torch.Tensor):
    """A forward hook adding ``delta`` ``(len(where), hidden)`` to a decoder layer's hidden
    states at rows ``where`` (batch 1)."""
    def hook(module, args, output):
        hs = output[0] if isinstance(output, tuple) else output
        hs = hs.index_add(1, where, delta.to(hs.dtype)[None])
        return (hs, *output[1:]) if isinstance(output, tuple) else hs
    return hook


def _ids(segments, packets_ids=None) -> list[int]:
    head, tail = packets_ids or ([], [])
    out: list[int] = []
    for kind, s in segments:
        out += (head + list(s) + tail) if kind == "chunk" else list(s)
    return out


def case_loss(hf_model, case: TrainCase, rows: torch.Tensor, k_header: int, base: int,
              question_sees_header: bool = True, *, bridge: bool = False, deep: torch.Tensor | None = None,
              recompute: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """Mean KL(teacher || student) over the case's question and answer positions, nats per
    token; differentiable in ``rows`` ``(k_header + k_trailer, hidden)`` and ``deep``
    (``student_layout`` says what ``bridge`` and ``recompute`` mean)."""
    k_trailer = rows.shape[0] - k_header
    lay = student_layout(case.segments, case.answer, k_header, k_trailer, base, bridge=bridge, recompute=recompute,
                         question_sees_header=question_sees_header)
    last = case.teacher_logp.shape[0]
    logits = student_logits(hf_model, lay.ids.to(rows.device), lay.mask, rows, base, last, positions=lay.positions,
                            deep=deep, deep_rows=lay.bridge_rows, k_header=k_header)
    logq = torch.log_softmax(logits, -1)
    logp = case.teacher_logp.to(logq.device).float()
    return (logp.exp() * (logp - logq)).sum(-1).mean()


@torch.no_grad()
def build_case(llm_full, question: str, docs: Sequence[str], system: str | None, answer_tokens: int = 16,
               answer: list[int] | None = None, *, teacher_orders: int = 0, seed: int = 0) -> TrainCase:
    """A distillation case: the teacher's greedy answer (``llm_full``: a ``LazyLLM`` with full
    attention, ``reuse="none"``) and its log-probabilities at the question's and answer's
    positions.

    ``teacher_orders``: 0, the teacher is full attention over the documents in the case's
    order; ``k`` > 0, the order-mean: the mean of full attention's distributions over the
    case's order and ``k`` other orders of its documents (``lazyllm.quality.floor.other_orders``,
    seeded by ``seed``), teacher-forced on the same answer: what an order-independent cache can
    aim for."""
    from .floor import other_orders

    segs = [(s.kind, list(s.ids)) for s in llm_full.prompts.build(question, [_chunk(d) for d in docs], system)]
    if answer is None:
        out = llm_full.generate(question, chunks=list(docs), system=system, max_new_tokens=answer_tokens)
        answer = list(out.token_ids) or [llm_full.tokenizer.eos_token_id]
    hf = llm_full.hf_model
    dev = next(hf.parameters()).device
    last = len(segs[-1][1]) + len(answer) - 1

    def logp(s):
        ids = torch.tensor(_ids(s) + answer[:-1], dtype=torch.long, device=dev)
        return torch.log_softmax(hf(input_ids=ids[None], use_cache=False, logits_to_keep=last).logits[0].float(), -1)

    teacher = logp(segs)
    perms = other_orders(len(docs), teacher_orders, seed) if teacher_orders > 0 else []
    if perms:
        others = [logp([(s.kind, list(s.ids)) for s in llm_full.prompts.build(
            question, [_chunk(docs[j]) for j in p], system)]) for p in perms]
        teacher = torch.logsumexp(torch.stack([teacher, *others]), 0) - math.log(len(others) + 1)
    return TrainCase(segs, answer, teacher.half().cpu(), list(docs))


def _chunk(text: str):
    from ..types import Chunk

    return Chunk(text)


def build_cases(llm_full, items: Sequence[dict], *, answer_tokens: int = 16, progress: bool = True,
                teacher_orders: int = 0) -> list[TrainCase]:
    """``build_case`` over items ``{"question", "documents", "system"?}``; the teachers' answers
    come from one batched ``generate_batch``. ``teacher_orders``: ``build_case``'s (0: the
    case's order; k: the order-mean over it and k other orders, item ``i`` seeded by ``i``)."""
    from tqdm.auto import tqdm

    gens = llm_full.generate_batch([dict(question=it["question"], chunks=list(it["documents"]),
                                         system=it.get("system"), max_new_tokens=answer_tokens) for it in items])
    out = []
    for i, (it, g) in enumerate(tqdm(list(zip(items, gens)), desc="teacher", unit="case", disable=not progress)):
        ans = list(g.token_ids) or [llm_full.tokenizer.eos_token_id]
        out.append(build_case(llm_full, it["question"], it["documents"], it.get("system"), answer=ans,
                              teacher_orders=teacher_orders, seed=i))
    return out


@torch.no_grad()
def mean_loss(hf_model, cases: Sequence[TrainCase], rows: torch.Tensor | None, k_header: int = 0,
              question_sees_header: bool = True, *, bridge: bool = False, deep: torch.Tensor | None = None) -> float:
    """Mean ``case_loss`` over ``cases`` (``rows=None``: isolated chunks without a packet)."""
    base = int(hf_model.get_input_embeddings().weight.shape[0])
    dev = next(hf_model.parameters()).device
    if rows is None:
        rows, k_header, bridge, deep = torch.zeros(0, hf_model.config.hidden_size, device=dev), 0, False, None
    rows = rows.to(dev, torch.float32)
    deep = deep.to(dev, torch.float32) if deep is not None else None
    return sum(float(case_loss(hf_model, c, rows, k_header, base, question_sees_header, bridge=bridge, deep=deep))
               for c in cases) / len(cases)


@torch.no_grad()
def init_packets(hf_model, tokenizer, k_header: int, k_trailer: int, seed: int = 0) -> torch.Tensor:
    """Starting rows ``(k_header + k_trailer, hidden)`` float32: the header from the embeddings of
    the text that precedes the documents in a prompt (what a chunk sees under full attention),
    the trailer from the embedding of a paragraph break; both with a little noise."""
    emb = hf_model.get_input_embeddings().weight.detach().float().cpu()
    g = torch.Generator().manual_seed(seed)
    text = "Answer the question using the documents below.\n\nDocuments:\n\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] or [0]
    head = [ids[max(0, len(ids) - k_header + i)] if len(ids) >= k_header else ids[i % len(ids)]
            for i in range(k_header)]
    nl = tokenizer("\n\n", add_special_tokens=False)["input_ids"] or [0]
    rows = torch.cat([emb[head], emb[nl[-1]].expand(k_trailer, -1)])
    noise = torch.randn(rows.shape, generator=g) * emb.std() * 0.1
    return (rows + noise).contiguous()


def _check_training(cases, k_header: int, k_trailer: int, *, bridge: bool, deep: bool, recompute) -> None:
    """``train_packets``' arguments that cannot train, refused before anything is made."""
    if not cases:
        raise InvalidRequestError("no training cases")
    if k_header < 0 or k_trailer < 0 or k_header + k_trailer == 0:
        raise InvalidRequestError(f"k_header={k_header}, k_trailer={k_trailer}: need at least one packet token")
    if deep and not (bridge and k_trailer):
        raise InvalidRequestError("deep bridge parameters need bridge=True and k_trailer > 0")
    if recompute is not None and len(recompute) != len(cases):
        raise InvalidRequestError(f"recompute has {len(recompute)} selections for {len(cases)} cases")


def train_packets(hf_model, tokenizer, cases: Sequence[TrainCase], *, k_header: int = 4, k_trailer: int = 4,
                  steps: int = 300, lr: float = 1e-2, batch: int = 1, seed: int = 0,
                  question_sees_header: bool = True, init: torch.Tensor | None = None,
                  time_limit_s: float | None = None, progress: bool = True, autocast: torch.dtype | None = None,
                  on_step: Callable[[int, float], None] | None = None, bridge: bool = False, deep: bool = False,
                  recompute: Sequence[Sequence[Sequence[int]] | None] | None = None) -> tuple[Packets, dict]:
    """Train a packet on ``cases`` with Adam; the model's weights stay frozen (their
    ``requires_grad`` is restored afterwards).

    ``bridge``: the trailer is a bridge, recomputed per request over the prefix and every
    earlier chunk (``student_layout``), as the engine runs a bridge packet. ``deep``: also
    train per-layer bridge parameters ``(layers, k_trailer, hidden)`` added to each layer's
    output at the bridge tokens (returned in the log as ``"deep"``; the engine does not run
    them). ``recompute``: per case, the chunk tokens the engine's recovery will recompute
    (``student_layout``), so the packet is trained with the recompute in the loop.

    Returns the ``Packets`` and a log ``{"losses": [...], "steps", "seconds", ...}``. Training
    stops after ``steps`` optimizer steps of ``batch`` cases each, or at ``time_limit_s``.
    ``autocast``: run the student forward and backward under ``torch.autocast`` in this dtype
    (``torch.bfloat16`` is faster on CPUs with AVX-512 BF16; the packet itself stays
    float32).
    """
    from tqdm.auto import tqdm

    _check_training(cases, k_header, k_trailer, bridge=bridge, deep=deep, recompute=recompute)
    dev = next(hf_model.parameters()).device
    base = int(hf_model.get_input_embeddings().weight.shape[0])
    rows0 = init if init is not None else init_packets(hf_model, tokenizer, k_header, k_trailer, seed)
    rows = torch.nn.Parameter(rows0.to(dev, torch.float32).clone())
    layers = len(hf_model.model.layers)
    deep_p = torch.nn.Parameter(torch.zeros(layers, k_trailer, rows.shape[1], device=dev)) if deep else None
    opt = torch.optim.Adam([rows] + ([deep_p] if deep_p is not None else []), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (
        1 + math.cos(math.pi * min(s, steps) / max(steps, 1))))
    saved = [(p, p.requires_grad) for p in hf_model.parameters()]
    for p, _ in saved:
        p.requires_grad_(False)
    rng = random.Random(seed)
    order: list[int] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    try:
        with tqdm(total=steps, desc="training packets", unit="step", disable=not progress) as bar:
            for step in range(steps):
                opt.zero_grad(set_to_none=True)
                total = 0.0
                for _ in range(batch):
                    if not order:
                        order = list(range(len(cases)))
                        rng.shuffle(order)
                    ci = order.pop()
                    with torch.autocast(dev.type, dtype=autocast or torch.float32, enabled=autocast is not None):
                        loss = case_loss(hf_model, cases[ci], rows, k_header, base, question_sees_header,
                                         bridge=bridge, deep=deep_p,
                                         recompute=recompute[ci] if recompute is not None else None)
                    (loss / batch).backward()
                    total += float(loss.detach()) / batch
                opt.step()
                sched.step()
                losses.append(total)
                bar.update(1)
                bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.4f}")
                if on_step is not None:
                    on_step(step, total)
                if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
                    break
    finally:
        for p, req in saved:
            p.requires_grad_(req)
    final = rows.detach().float().cpu()
    from ..model.llama import LlamaFamilyModel

    info = dict(chunk_context="isolated", question_sees_header=question_sees_header, steps=len(losses),
                cases=len(cases), lr=lr, batch=batch, seed=seed, recompute_in_loop=recompute is not None)
    packets = Packets(final[:k_header].clone(), final[k_header:].clone(),
                      model_id(LlamaFamilyModel(hf_model, fuse=False, fused_kernels=False)), info,
                      bridge=bridge)
    log = dict(losses=losses, steps=len(losses), seconds=time.perf_counter() - t0)
    if deep_p is not None:
        log["deep"] = deep_p.detach().float().cpu()
    return packets, log
