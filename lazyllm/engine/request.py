"""A request as the engine sees it, and the page-table vocabulary every part shares.

A request's page table lists ``TableEntry`` rows: a page, the logical position of its first
slot in the request, the rotation (delta) the attention kernel applies to its stored keys,
and how many of its slots are valid. Entries are frozen: a request's table changes only
through its ``page_table.Allocation``. ``pack_tables`` turns tables into the four int planes
(page, pos, delta, len) the kernels read, in one place for prefill, decode and graphs.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..types import Chunk, GenerationOutput, SamplingParams

if TYPE_CHECKING:
    from .detokenizer import Detokenizer
    from .kv.page_table import Allocation
    from .running.sampler import TokenConstraint
    from .step import Recomputation

_request_ids = itertools.count(1)


class TableEntry(NamedTuple):
    """One row of a page table (immutable: a tuple, cheap to make once per decode step)."""

    page: int
    pos: int  # position of slot 0 in the request's frame
    delta: int  # rotation added to stored keys
    length: int  # valid slots


@dataclass
class Segment:
    """A run of a request's prompt tokens: the ``prefix`` (system prompt and template
    header), one ``chunk`` per document (with its ``Chunk``), or the ``suffix`` (the question
    and the template tail)."""

    kind: str  # "prefix", "chunk" or "suffix"
    ids: list[int]
    chunk: Chunk | None = None
    # the memo of these ids' cache keys, shared by every segment of one cached encoding
    # (``lazyllm.inputs.encodings``; read and filled by ``cache.store.segment_keys``)
    memo: dict | None = field(default=None, compare=False, repr=False)


@dataclass
class Job:
    """One sequence of new tokens in a prefill forward."""

    ids: list[int]
    start_pos: int
    own_pages: list[int]
    context: list[TableEntry]  # cached pages it attends to besides its own
    logit_rows: int = 0  # how many of its last tokens need logits (1 to sample, more to score)
    # explicit per-token positions and KV slots (tokens scattered over pages, as in
    # recomputation); then ``context`` lists every page attended to, its own included
    positions: list[int] | None = None
    slots: list[int] | None = None
    # the retrieved documents' key positions [start, end) for context calibration (queries at
    # or past ``end`` read them with the backend's context temperature and LSE scale)
    ctx: tuple[int, int] | None = None

    def __post_init__(self):
        if self.logit_rows > len(self.ids):  # a planner bug: the forward could not produce them
            raise ValueError(f"a prefill job of {len(self.ids)} tokens cannot give logits of its last "
                             f"{self.logit_rows}")


@dataclass
class ChunkSpan:
    """Where one chunk of a request sits: its logical start, its tokens, the index of its
    first page in the request's table, whether this request computes it, and its pages."""

    start: int
    ids: list[int]
    first_entry: int
    computed_now: bool
    entries: list[TableEntry]


@dataclass
class PrefillPlan:
    """What the KV planner decided for one request (``Request.plan``); only the planner
    writes it, and the plan itself (``recomputed``, ``prefilled``).

    ``job``: the request's own forward (suffix, or the whole prompt in full-attention modes).
    ``copies``: ``(src page, dst page, delta)`` re-rotated private copies to make first.
    ``spans``, ``context``, ``own``: the chunk layout, the cached table before the suffix
    and the suffix's pages, for quality recovery. ``chain``: identical-prefix page keys and
    how many were reused, for handing the prompt's full pages to the store afterwards.
    These are consumed by the prefill (``prefilled`` drops them); the token counts stay for
    the request's usage, and ``next_pos``, where its decoding starts (the engine sets
    ``RequestState.next_pos`` from it). Quality recovery replaces the job and adds copies in
    the step's ``PrefillBatch``, not here. A new plan (after preemption) counts from zero."""

    job: Job | None = None
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    spans: list[ChunkSpan] = field(default_factory=list)
    context: list[TableEntry] = field(default_factory=list)
    own: list[int] = field(default_factory=list)
    suffix_ids: list[int] = field(default_factory=list)
    suffix_pos: int = 0
    chain: tuple[list[bytes], int] | None = None
    ctx_range: tuple[int, int] | None = None  # its documents' positions [start, end), if any
    cached_tokens: int = 0  # prompt tokens read from the cache
    cached_chunk_tokens: int = 0  # of those, chunk tokens
    computed_tokens: int = 0  # tokens this request runs through the model in prefill
    next_pos: int = 0  # logical position of the first token decoded after the prompt

    def recomputed(self, rc: Recomputation) -> None:
        """Quality recovery recomputes ``rc.computed`` chunk tokens, ``rc.reused`` of them
        counted as read from the cache: the counts move from reused to computed."""
        self.cached_tokens -= rc.reused
        self.cached_chunk_tokens -= rc.reused
        self.computed_tokens += rc.computed

    def prefilled(self) -> None:
        """The prefill ran: drop what only it needed, keep the counts."""
        self.job, self.copies, self.spans, self.context, self.chain = None, [], [], [], None


@dataclass
class RequestState:
    """Where the engine is with a request: scheduling and decoding (engine thread only)."""

    next_pos: int = 0  # logical position of the next token to decode
    generated: list[int] = field(default_factory=list)
    admit_time: float = 0.0
    first_token_time: float = 0.0
    finish_reason: str | None = None
    row: int | None = None  # row in the decode state while decoding
    preempted: bool = False
    solo: bool = False  # prefill alone (a batched prefill with it failed)
    # prefilled again with every chunk token recomputed (``escalate_below``: its reuse pass left
    # the first answer token undecided)
    escalated: bool = False
    # its answer tokens' margins are checked while decoding (``escalate_tokens`` > 1: it was
    # checked at its first token and kept its reuse answer)
    watched: bool = False
    # what to prefill when readmitted after preemption: the submitted segments with the
    # generated tokens appended to the suffix (None: the submitted segments)
    resumed: list[Segment] | None = None


@dataclass(frozen=True)
class Scoring:
    """What a scoring request scores: the log-probabilities of ``ids`` (the continuation,
    token ids) teacher-forced after ``prompt`` (the segments its result reports; the request
    prefills them with all but the last continuation token appended to the suffix), and
    whether the result carries the full logits."""

    ids: list[int]
    prompt: list[Segment]
    return_logits: bool = False
    top: int = 0  # how many most likely tokens to report per place (``ScoreOutput.top_logprobs``)
    # the finished generation whose tokens these are: its ``logprobs`` are filled from this
    # result and it is handed out in place of the scores (``OutputProcessor.logprob_request``)
    fills: Any = None


@dataclass(eq=False)  # one request is one object: compared and hashed by identity
class Request:
    """A request as the caller submitted it (and reads its events from), with two parts the
    engine fills: ``plan``, what the KV planner decided (with ``alloc``, its pages and page
    table, which only the planner's ``Allocation`` edits), and ``state``, the scheduling and
    decoding state."""

    segments: list[Segment]
    params: SamplingParams
    events: queue.Queue
    # when the engine's side of the request began (made, its prompt tokenized): ``engine_ttft_s``
    submit_time: float = field(default_factory=time.perf_counter)
    # when the caller's call began, or the server received the request: ``ttft_s``, ``total_s``
    received_at: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None
    warm_only: bool = False  # compute prefix and chunk KV, generate nothing
    score: Scoring | None = None  # a teacher-forced scoring request, finished after its prefill
    streaming: bool = True  # emit text deltas as tokens come (False: decode the text once at the end)
    detok: Detokenizer | None = None
    # the seed of its sampled tokens (``params.seed``, else drawn when the request was made);
    # each token's draw is a function of it and the token's index
    seed: int | None = None
    # structured output: the grammar each token must follow (``sampler.TokenConstraint``), and
    # what turns the finished text into parsed values or tool calls (``GenerationOutput`` ->
    # ``GenerationOutput``), run once when the result is built
    constraint: TokenConstraint | None = None
    finalize: Callable[[GenerationOutput], GenerationOutput] | None = None
    # the generated tokens' log-probabilities: None (not asked) or how many most likely
    # tokens to report per place (0: only the generated one's), and the front door's maker of
    # the scoring request that computes them ``(request, tokens, output) -> Request``
    logprobs: int | None = None
    scoring_of: Callable[[Request, list[int], GenerationOutput], Request] | None = None
    id: int = field(default_factory=_request_ids.__next__)  # unique in the process, never reused
    plan: PrefillPlan | None = None  # set by ``KVPlanner.plan``, reset by ``unplan``
    alloc: Allocation | None = None  # made by the planner on the first plan
    state: RequestState = field(default_factory=RequestState)

    @property
    def logit_rows(self) -> int:
        """How many of its last prompt tokens need logits: 1 to sample its first token, the
        continuation's length to score it."""
        return 1 if self.score is None else len(self.score.ids)

    @property
    def prefill_segments(self) -> list[Segment]:
        """The segments to prefill: as submitted, or resumed after preemption."""
        return self.state.resumed or self.segments

    @property
    def prompt_ids(self) -> list[int]:
        return [t for s in self.prefill_segments for t in s.ids]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(s.ids) for s in self.prefill_segments)


def slot_of(pages: list[int], i: int, page_size: int) -> int:
    """Pool slot of the ``i``-th token laid out over ``pages``."""
    return pages[i // page_size] * page_size + i % page_size


# a row from a 4-tuple, without ``_make``'s call through a classmethod and length check (a
# warm request over 8 chunks of 512 builds about 260 rows while the GPU waits for it)
_row = partial(tuple.__new__, TableEntry)


def entry_table(pages: list[int], num_tokens: int, pos: int, delta: int, page_size: int) -> list[TableEntry]:
    """Table rows of ``num_tokens`` tokens stored in ``pages``, placed at logical position
    ``pos`` with rotation ``delta``."""
    k = len(pages)
    last = num_tokens - (k - 1) * page_size
    if 0 < last <= page_size:  # every page full but the last: the usual layout
        lens = [page_size] * (k - 1) + [last]
    else:
        lens = [min(page_size, num_tokens - i) for i in range(0, k * page_size, page_size)]
    return list(map(_row, zip(pages, range(pos, pos + k * page_size, page_size), repeat(delta, k), lens)))


def pack_tables(tables: list[list[TableEntry]] | list[list[tuple]], width: int) -> np.ndarray:
    """``(4, len(tables), width)`` int64 planes (page, pos, delta, len) of page tables
    (``TableEntry`` rows or ``(page, pos, delta, len)`` tuples), zero-padded: a padding
    entry has length 0 and is never read."""
    out = np.zeros((4, len(tables), width), dtype=np.int64)
    for b, t in enumerate(tables):
        if t:  # rows are 4-tuples (``TableEntry`` is one): flattened, no per-row conversion
            out[:, b, :len(t)] = np.fromiter(chain.from_iterable(t), dtype=np.int64, count=4 * len(t)).reshape(-1, 4).T
    return out
