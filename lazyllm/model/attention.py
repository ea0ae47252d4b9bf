"""Attention backends: where a kernel is chosen.

A backend is an object with ``plan(meta, inv_freq)``, called once per forward (a step) and
RoPE frequency vector, and ``run(q, meta, k_cache, v_cache, inv_freq, sm_scale, plan)``,
called per layer: FlashInfer's plan/run split. ``plan`` builds what every layer of the step
shares (the Triton backend's rotation table and launch settings); ``run`` only launches.
Each backend also gives its re-rotating page copy (``rerotate_copy``), the attention mass
of a step's queries per key slot (``mass``) and says whether its forwards can be captured
in CUDA graphs.

* ``TorchAttention``: the plain-torch reference (``lazyllm.kernels.reference``), any device.
* ``TritonAttention``: the Triton kernels, compiled on CUDA, run in Triton's interpreter on
  CPU (for tests), with ``lazyllm.kernels.KernelOptions`` for launch choices.

``make_backend`` picks one by name; ``"auto"`` is Triton on CUDA and torch on CPU.
"""
from __future__ import annotations

from typing import Any

import torch

from lazyllm.kernels import reference


class AttentionBackend:
    """Deferred-RoPE paged attention for the model's layers."""

    name = ""
    graph_capturable = False  # whether a forward through it can be captured in a CUDA graph
    supports_window = False  # whether run() takes ``window`` (sliding-window layers)
    # APE-style context calibration, (temperature, LSE scale): queries past a sequence's
    # documents (``meta.ctx_range``) read the documents' logits divided by the temperature and
    # their log-sum-exp scaled (``reference.paged_attention_ref``); (1, 1): off
    calibration: tuple[float, float] = (1.0, 1.0)

    @property
    def calibrated(self) -> bool:
        return self.calibration != (1.0, 1.0)

    def _ctx(self, meta) -> dict:
        """The calibration arguments of a kernel call for this step (none when off)."""
        if meta.ctx_range is None or not self.calibrated:
            return {}
        return dict(ctx_range=meta.ctx_range, ctx_temperature=self.calibration[0], ctx_lse_scale=self.calibration[1])

    def plan(self, meta, inv_freq: torch.Tensor) -> Any:
        """Per-step state shared by every layer that uses ``inv_freq``."""
        return None

    def run(self, q: torch.Tensor, meta, k_cache: torch.Tensor, v_cache: torch.Tensor, inv_freq: torch.Tensor,
            sm_scale: float, plan: Any, *, window: int | None = None) -> torch.Tensor:
        """Attention output ``(total_q, num_q_heads, head_dim)`` of queries ``q`` (RoPE
        applied at ``meta.positions``) over one layer's pages ``k_cache``/``v_cache``
        ``(num_pages, page_size, num_kv_heads, head_dim)``. ``window``: a sliding window
        (a query at ``p`` sees keys at ``p - window < pos <= p``), only where
        ``supports_window``."""
        raise NotImplementedError

    def rerotate_copy(self, k_cache, v_cache, src, dst, delta, inv_freq) -> None:
        """Copy pages ``src -> dst`` (all layers of ``k_cache``/``v_cache``), keys rotated by
        ``delta``."""
        raise NotImplementedError

    def mass(self, q: torch.Tensor, meta, k_cache: torch.Tensor, v_cache: torch.Tensor, inv_freq: torch.Tensor,
             sm_scale: float, *, window: int | None = None, plan: Any = None) -> torch.Tensor:
        """Attention mass each table slot gets from the queries ``q`` (the softmax
        probabilities of ``run``, summed over query heads and each sequence's queries),
        ``(batch, max_blocks, page_size)`` float32: what attention-guided recompute reads.
        ``plan``: this step's ``plan(meta, inv_freq)``, where the backend can share it. The
        torch reference by default."""
        return reference.paged_attention_mass_ref(q, meta.positions, meta.cu_seqlens_q, k_cache, v_cache,
                                                  meta.block_table, meta.block_pos, meta.block_delta,
                                                  meta.block_len, inv_freq, sm_scale, window=window)


class TorchAttention(AttentionBackend):
    """The plain-torch reference: reads the batch layout on the host (no CUDA graphs)."""

    name = "torch"
    graph_capturable = False
    supports_window = True

    def run(self, q, meta, k_cache, v_cache, inv_freq, sm_scale, plan, *, window=None):
        return reference.paged_attention_ref(q, meta.positions, meta.cu_seqlens_q, k_cache, v_cache,
                                             meta.block_table, meta.block_pos, meta.block_delta, meta.block_len,
                                             inv_freq, sm_scale, window=window, **self._ctx(meta))

    def rerotate_copy(self, k_cache, v_cache, src, dst, delta, inv_freq) -> None:
        reference.rerotate_copy_ref(k_cache, v_cache, src, dst, delta, inv_freq)


class TritonAttention(AttentionBackend):
    """The Triton kernels (``lazyllm.kernels``)."""

    name = "triton"
    graph_capturable = True
    supports_window = True

    def __init__(self, device: torch.device, *, batch_invariant: bool = False, options=None):
        from lazyllm.kernels import triton_kernels

        # on CPU the real kernels run in Triton's interpreter, from a private copy of the
        # modules (so it does not matter what imported the compiled ones before)
        self.kernels = triton_kernels(interpret=device.type == "cpu")
        self.batch_invariant = batch_invariant
        self.options = options
        # the page pool is zero-initialized and only written with K/V (cache/store.py), so
        # every slot the tables name is finite: prefill may read whole pages (the Gluon kernel)
        self.padding_finite = device.type == "cuda"

    def plan(self, meta, inv_freq):
        extras = {"max_seqlen_q": meta.max_seqlen_q, "rope": self.kernels.rope_table(meta.block_delta, inv_freq)}
        if self.batch_invariant:
            extras["batch_invariant"] = True
        if self.padding_finite:
            extras["padding_finite"] = True
        if self.options is not None:
            extras["options"] = self.options
        return extras

    def run(self, q, meta, k_cache, v_cache, inv_freq, sm_scale, plan, *, window=None):
        sh = meta.shared
        ctx = self._ctx(meta)
        if sh is not None and window is None and not ctx:  # a decode step whose requests share pages
            return self.kernels.grouped_attention_triton(
                q, meta.positions, k_cache, v_cache, meta.block_table, meta.block_pos, meta.block_delta,
                meta.block_len, inv_freq, sm_scale, sh.plan, members_per_item=sh.members_per_item,
                part_o=sh.part_o, part_lse=sh.part_lse)
        if window is not None:  # sliding-window layers (the others' launch is unchanged)
            return self.kernels.paged_attention_triton(
                q, meta.positions, meta.cu_seqlens_q, k_cache, v_cache, meta.block_table, meta.block_pos,
                meta.block_delta, meta.block_len, inv_freq, sm_scale, window=window, **plan, **ctx)
        return self.kernels.paged_attention_triton(q, meta.positions, meta.cu_seqlens_q, k_cache, v_cache,
                                              meta.block_table, meta.block_pos, meta.block_delta, meta.block_len,
                                              inv_freq, sm_scale, **plan, **ctx)

    def rerotate_copy(self, k_cache, v_cache, src, dst, delta, inv_freq) -> None:
        self.kernels.rerotate_copy_triton(k_cache, v_cache, src, dst, delta, inv_freq)

    def mass(self, q, meta, k_cache, v_cache, inv_freq, sm_scale, *, window=None, plan=None):
        rope = plan.get("rope") if isinstance(plan, dict) else None  # the step's rotation table, when planned
        return self.kernels.paged_attention_mass_triton(
            q, meta.positions, meta.cu_seqlens_q, k_cache, v_cache, meta.block_table, meta.block_pos,
            meta.block_delta, meta.block_len, inv_freq, sm_scale, window=window, max_seqlen_q=meta.max_seqlen_q,
            rope=rope)


def make_backend(name: str, device: torch.device, *, batch_invariant: bool = False,
                 options=None, calibration: tuple[float, float] = (1.0, 1.0)) -> AttentionBackend:
    """The backend ``name`` (``"auto"``, ``"torch"`` or ``"triton"``) for ``device``, with
    context ``calibration`` ``(temperature, LSE scale)``, as ``lazyllm.config.EngineConfig``
    validated them. Raises ``ImportError`` where Triton is missing."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    backend = TorchAttention() if name == "torch" else TritonAttention(device, batch_invariant=batch_invariant,
                                                                      options=options)
    backend.calibration = tuple(float(x) for x in calibration)
    return backend
