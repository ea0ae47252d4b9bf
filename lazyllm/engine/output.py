"""Output: turns a request's logits into tokens and text, and its end into a result.

``OutputProcessor`` takes each new token (picked by the ``Sampler``), advances the request's
token constraint past it, streams its text (``Detokenizer``), decides when a request is done
(EOS, a stop string, a complete constraint, its length or the model's context) and builds
the ``GenerationOutput`` / ``ScoreOutput`` or the error the caller receives on the
request's event queue. It never touches pages: the engine retires a
request (frees what it holds) before handing its result out.
"""
from __future__ import annotations

import time

import torch

from ..errors import LazyLLMError, RequestCancelled
from ..types import GenerationOutput, ScoreOutput, TokenLogprob, Usage
from .metrics import EngineMetrics
from .request import Request

__all__ = ["OutputProcessor"]


def _start(r: Request) -> float:
    """Where the caller's figures count from: the call (or the server's receipt of the
    request), else the engine's receipt."""
    return r.submit_time if r.received_at is None else r.received_at


class OutputProcessor:
    """Tokens, text and results of requests (engine thread only)."""

    def __init__(self, tokenizer, eos_ids: set[int], max_context: int, metrics: EngineMetrics):
        self.tok, self.eos_ids, self.max_context, self.metrics = tokenizer, eos_ids, max_context, metrics

    def emit(self, r: Request, tok: int) -> bool:
        """Append the request's next token and stream its text; True when the request is done
        (``r.state.finish_reason`` set). Raises ``LazyLLMError`` when the request's constraint
        rejects the token (the caller fails the request)."""
        if r.constraint is not None and not r.constraint.accept(tok):
            raise LazyLLMError(f"the token constraint rejected token {tok}, which its own mask allowed")
        if not r.state.generated and not r.state.first_token_time:
            # the first token exists once it is sampled (the forward before it may still have
            # been running on the GPU when the host got here); a recomputed request keeps its own
            r.state.first_token_time = time.perf_counter()
        r.state.generated.append(tok)
        is_eos = tok in self.eos_ids
        # a complete grammar ends the answer even without an end-of-sequence token
        complete = r.constraint is not None and r.constraint.is_terminated()
        if r.streaming or r.params.stop:  # text is needed now: for the caller, or to stop
            delta = r.detok.add(tok) if not is_eos else r.detok.finish()
            if delta:
                r.events.put(("delta", delta))
        if is_eos or complete or r.detok.stopped:
            r.state.finish_reason = "stop"
        elif len(r.state.generated) >= r.params.max_new_tokens or r.state.next_pos >= self.max_context:
            r.state.finish_reason = "length"
        if r.state.finish_reason:
            if not (r.streaming or r.params.stop):  # detokenize once, at the end
                for t in (r.state.generated[:-1] if is_eos else r.state.generated):
                    r.detok.ids.append(t)
                r.detok.text = self.tok.decode(r.detok.ids, skip_special_tokens=True)
            tail = r.detok.finish()
            if tail:
                r.events.put(("delta", tail))
            return True
        return False

    def fail(self, r: Request, error: Exception) -> None:
        """Hand the caller the request's error."""
        if isinstance(error, RequestCancelled):
            self.metrics.cancelled += 1
        else:
            self.metrics.failed += 1
        r.events.put(("error", error))

    def done(self, r: Request) -> Request | None:
        """Hand the caller the finished request's ``GenerationOutput`` (finalized: a structured
        request's parsed answer or tool calls filled in); where it asked for ``logprobs``,
        return the scoring request that fills them instead (the engine submits it)."""
        now = time.perf_counter()
        segs = r.segments
        out = GenerationOutput(
            text=r.detok.text,
            token_ids=list(r.state.generated),
            prompt_segments=[(s.kind, list(s.ids)) for s in segs],
            usage=Usage(prompt_tokens=sum(len(s.ids) for s in segs), cached_tokens=r.plan.cached_tokens,
                        completion_tokens=len(r.state.generated), cached_chunk_tokens=r.plan.cached_chunk_tokens),
            finish_reason=r.state.finish_reason or "stop",
            ttft_s=r.state.first_token_time - _start(r),
            total_s=now - _start(r),
            queue_s=r.state.admit_time - r.submit_time,
            chunk_ids=[s.chunk.id for s in r.segments if s.kind == "chunk"],
            engine_ttft_s=r.state.first_token_time - r.submit_time,
        )
        if r.finalize is not None:
            try:
                out = r.finalize(out)
            except Exception as e:  # the caller's parser: its error is the request's, not the engine's
                self.fail(r, e)
                return None
        if r.logprobs is not None:
            follow = self.logprob_request(r, out)
            if follow is not None:
                return follow
        self.metrics.requests += 1
        r.events.put(("done", out))
        return None

    def logprob_request(self, r: Request, out: GenerationOutput) -> Request | None:
        """The scoring request of ``r``'s generated tokens (an end-of-sequence token left out),
        teacher-forced after ``r``'s own prompt segments: its scores are ``LazyLLM.score``'s by
        construction, and its result completes ``out`` (``done_score``). None when there is
        nothing to score (``out.logprobs`` is then empty)."""
        cont = list(out.token_ids)
        if cont and cont[-1] in self.eos_ids:
            cont.pop()
        if not cont:
            out.logprobs = []
            return None
        return r.scoring_of(r, cont, out)

    def score(self, r: Request, logits: torch.Tensor) -> ScoreOutput:
        """Teacher-forced log-probabilities of the continuation (the last ``logit_rows``
        tokens of the suffix are the continuation shifted by one)."""
        cont = r.score.ids
        logp = torch.log_softmax(logits.float(), dim=-1)
        idx = torch.tensor(cont, device=logp.device)
        token_logp = logp.gather(1, idx[:, None])[:, 0]
        top = None
        if r.score.top:
            vals, ids = logp.topk(r.score.top, dim=-1)
            top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        r.state.first_token_time = time.perf_counter()
        segs = r.score.prompt
        return ScoreOutput(
            token_ids=list(cont), logprobs=token_logp.tolist(),
            logits=logits.float().cpu() if r.score.return_logits else None,
            prompt_segments=[(sg.kind, list(sg.ids)) for sg in segs],
            usage=Usage(prompt_tokens=sum(len(sg.ids) for sg in segs), cached_tokens=r.plan.cached_tokens,
                        completion_tokens=0, cached_chunk_tokens=r.plan.cached_chunk_tokens),
            prefilled_tokens=r.plan.computed_tokens,
            ttft_s=r.state.first_token_time - _start(r), engine_ttft_s=r.state.first_token_time - r.submit_time,
            top_logprobs=top)

    def done_score(self, r: Request, result: ScoreOutput) -> None:
        self.metrics.requests += 1
        out = r.score.fills
        if out is None:
            r.events.put(("done", result))
            return

        def token(i: int) -> str:
            return self.tok.decode([i])

        tops = result.top_logprobs or [[] for _ in result.token_ids]
        out.logprobs = [TokenLogprob(t, token(t), lp, tuple(TokenLogprob(i, token(i), v) for i, v in top))
                        for t, lp, top in zip(result.token_ids, result.logprobs, tops)]
        r.events.put(("done", out))
