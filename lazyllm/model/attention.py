"""Attention backends: the one place where a step's attention kernel is chosen.

A backend is an object with ``plan(meta, inv_freq)``, called once per forward (a step) and
RoPE frequency vector, and ``run(q, meta, k_cache, v_cache, inv_freq, sm_scale, plan)``,
called per layer: FlashInfer's plan/run split. ``plan`` returns a ``StepPlan``, which names
the kernel of every layer kind of the step (``Kernel``: the torch reference, the paged
kernel, or shared-chunk decode for layers without a window) and holds what every layer
shares (calibration arguments, the Triton backend's rotation table and launch settings);
``run`` only launches what the plan names. Each backend also says whether a step of it can
read shared pages once (``shared_decode``), gives its re-rotating page copy
(``rerotate_copy``) and the attention mass of a step's queries per key slot (``mass``), and
says whether its forwards can be captured in CUDA graphs.

* ``TorchAttention``: the plain-torch reference (``lazyllm.kernels.reference``), any device.
* ``TritonAttention``: the Triton kernels, compiled on CUDA, run in Triton's interpreter on
  CPU (for tests), with ``lazyllm.KernelOptions`` for launch choices. Inside a
  paged launch, the kernel and its key-tile loop (``lazyllm.kernels.options.KeyLoop``) are
  chosen by the launcher from the shapes (``kernels/triton/launcher.py``, ``LaunchPlan``).

``make_backend`` picks one by name; ``"auto"`` is Triton on CUDA and torch on CPU.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from lazyllm.kernels import reference
from lazyllm.kernels.options import KernelOptions, calibration_on

_DEFAULT_OPTIONS = KernelOptions()


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the engine and shared by every layer.

    Shapes: ``positions`` / ``slot_mapping`` ``(total_tokens,)``; ``cu_seqlens_q``
    ``(batch + 1,)``; ``block_*`` ``(batch, max_blocks)``. See ``lazyllm.kernels.reference``
    for the meaning of each block field.
    """

    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    block_pos: torch.Tensor
    block_delta: torch.Tensor
    block_len: torch.Tensor
    max_seqlen_q: int
    shared: SharedMeta | None = None  # a decode step's shared-chunk plan, where one applies
    # (batch, 2) int32: each sequence's document positions [start, end) for the backend's
    # context calibration (``AttentionBackend.calibration``); None: no calibration this step
    ctx_range: torch.Tensor | None = None


@dataclass
class SharedMeta:
    """A decode step's shared-chunk attention plan (``lazyllm.kernels.grouping``) as the
    Triton backend reads it: the plan's tensors, its query tile, the partial-state scratch."""

    plan: Any
    members_per_item: int
    part_o: torch.Tensor
    part_lse: torch.Tensor


class Kernel(enum.Enum):
    """The attention kernels a layer of a step can run."""

    REFERENCE = "reference"  # plain-torch paged attention: reads the batch layout on the host
    PAGED = "paged"  # the paged kernel, per sequence (its loop chosen by the launcher)
    GROUPED = "grouped"  # shared-chunk decode: a shared page read once for every row holding it


@dataclass(frozen=True)
class StepPlan:
    """A step's attention choices for one RoPE frequency, made by ``AttentionBackend.plan``.

    ``full`` / ``windowed``: the kernel of the layers without / with a sliding window;
    ``ctx``: the calibration arguments of a kernel call (empty: off); ``launch``: what every
    paged launch of the step shares (the Triton backend's rotation table and flags)."""

    full: Kernel
    windowed: Kernel
    ctx: dict = field(default_factory=dict)
    launch: dict = field(default_factory=dict)

    def kernel(self, window: int | None) -> Kernel:
        return self.full if window is None else self.windowed


class AttentionBackend:
    """Deferred-RoPE paged attention for the model's layers."""

    name = ""
    graph_capturable = False  # whether a forward through it can be captured in a CUDA graph
    # APE-style context calibration, (temperature, LSE scale): queries past a sequence's
    # documents (``meta.ctx_range``) read the documents' logits divided by the temperature and
    # their log-sum-exp scaled (``reference.paged_attention_ref``); (1, 1): off
    calibration: tuple[float, float] = (1.0, 1.0)
    kernel = Kernel.PAGED  # what the layers run where nothing else is chosen (``launch``)

    @property
    def calibrated(self) -> bool:
        return calibration_on(*self.calibration)

    def shared_decode(self, head_dim: int, page_size: int) -> bool:
        """Whether decode steps whose requests hold the same pages can read each shared page
        once (``Kernel.GROUPED``) with this backend, model and pool."""
        return False

    def plan(self, meta: AttentionMetadata, inv_freq: torch.Tensor) -> StepPlan:
        """The step's choices for the layers that use ``inv_freq``."""
        ctx = {}
        if meta.ctx_range is not None and self.calibrated:
            ctx = dict(ctx_range=meta.ctx_range, ctx_temperature=self.calibration[0],
                       ctx_lse_scale=self.calibration[1])
        full = self.kernel
        if full is Kernel.PAGED and meta.shared is not None and not ctx:  # a decode step whose rows share pages
            full = Kernel.GROUPED
        return StepPlan(full=full, windowed=self.kernel, ctx=ctx, launch=self.launch_settings(meta, inv_freq))

    def launch_settings(self, meta: AttentionMetadata, inv_freq: torch.Tensor) -> dict:
        """What every paged launch of the step shares (``StepPlan.launch``)."""
        return {}

    def launch_variants(self, model, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: int, max_seqlen_q: int,
                        width: int, row_stride: int, plane: int | None = None) -> frozenset:
        """What one launch shape compiles (the warm-up asks, to find the shapes that compile
        different kernels): two shapes with the same variants run the same compiled kernels.
        Nothing here: no kernel of this backend specializes on shapes."""
        return frozenset()

    def run(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
            inv_freq: torch.Tensor, sm_scale: float, plan: StepPlan, *, window: int | None = None) -> torch.Tensor:
        """Attention output ``(total_q, num_q_heads, head_dim)`` of queries ``q`` (RoPE
        applied at ``meta.positions``) over one layer's pages ``k_cache``/``v_cache``
        ``(num_pages, page_size, num_kv_heads, head_dim)``, with the kernel ``plan`` names for
        the layer. ``window``: a sliding window (a query at ``p`` sees keys at
        ``p - window < pos <= p``)."""
        kernel = plan.kernel(window)
        if kernel is Kernel.REFERENCE:
            return reference.paged_attention_ref(q, meta.positions, meta.cu_seqlens_q, k_cache, v_cache,
                                                 meta.block_table, meta.block_pos, meta.block_delta, meta.block_len,
                                                 inv_freq, sm_scale, window=window, **plan.ctx)
        return self.launch(kernel, q, meta, k_cache, v_cache, inv_freq, sm_scale, plan, window)

    def launch(self, kernel: Kernel, q, meta, k_cache, v_cache, inv_freq, sm_scale, plan: StepPlan, window):
        """Run ``kernel`` (``PAGED`` or ``GROUPED``), as ``run``."""
        raise NotImplementedError(f"the {self.name} backend has no {kernel.value} kernel")

    def rerotate_copy(self, k_cache, v_cache, src, dst, delta, inv_freq) -> None:
        """Copy pages ``src -> dst`` (all layers of ``k_cache``/``v_cache``), keys rotated by
        ``delta``."""
        raise NotImplementedError

    def mass(self, q: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
             inv_freq: torch.Tensor, sm_scale: float, *, window: int | None = None,
             plan: StepPlan | None = None) -> torch.Tensor:
        """Attention mass each table slot gets from the queries ``q`` (the softmax
        probabilities of ``run``, summed over query heads and each sequence's queries),
        ``(batch, max_blocks, page_size)`` float32: what attention-guided recompute reads.
        ``plan``: this step's ``plan(meta, inv_freq)``, where the backend can share it. The
        torch reference where the plan names it for the layer."""
        return reference.paged_attention_mass_ref(q, meta.positions, meta.cu_seqlens_q, k_cache, v_cache,
                                                  meta.block_table, meta.block_pos, meta.block_delta,
                                                  meta.block_len, inv_freq, sm_scale, window=window)


class TorchAttention(AttentionBackend):
    """The plain-torch reference: reads the batch layout on the host (no CUDA graphs)."""

    name = "torch"
    graph_capturable = False
    kernel = Kernel.REFERENCE

    def rerotate_copy(self, k_cache, v_cache, src, dst, delta, inv_freq) -> None:
        reference.rerotate_copy_ref(k_cache, v_cache, src, dst, delta, inv_freq)


class TritonAttention(AttentionBackend):
    """The Triton kernels (``lazyllm.kernels``)."""

    name = "triton"
    graph_capturable = True

    def __init__(self, device: torch.device, *, batch_invariant: bool = False, options=None):
        from lazyllm.kernels.loader import triton_kernels

        # on CPU the real kernels run in Triton's interpreter, from a private copy of the
        # modules (so it does not matter what imported the compiled ones before)
        self.kernels = triton_kernels(interpret=device.type == "cpu")
        self.batch_invariant = batch_invariant
        self.options = options
        # the page pool is zero-initialized and only written with K/V (cache/store.py), so
        # every slot the tables name is finite: prefill may read whole pages (the Gluon kernel)
        self.padding_finite = device.type == "cuda"

    def shared_decode(self, head_dim: int, page_size: int) -> bool:
        # where the grouped kernel applies and was measured (head_dim up to 128 on H200);
        # context calibration has no grouped kernel (its steps take the per-request one),
        # and batch invariance wants one launch configuration for every step
        opts = self.options or _DEFAULT_OPTIONS
        d, ps = head_dim, page_size
        return (opts.shared_decode and not self.batch_invariant and not self.calibrated and ps >= 16
                and 16 <= d <= 128 and not ps & (ps - 1) and not d & (d - 1))

    def launch_settings(self, meta, inv_freq):
        extras = {"max_seqlen_q": meta.max_seqlen_q, "rope": self.kernels.rope_table(meta.block_delta, inv_freq)}
        if self.batch_invariant:
            extras["batch_invariant"] = True
        if self.padding_finite:
            extras["padding_finite"] = True
        if self.options is not None:
            extras["options"] = self.options
        return extras

    def launch_variants(self, model, k_cache, v_cache, batch, max_seqlen_q, width, row_stride, plane=None):
        # the ``specialization`` of each ``LaunchPlan`` the launcher would make
        from lazyllm.kernels.triton.launcher import launch_variants

        return launch_variants(model, k_cache, v_cache, batch, max_seqlen_q, width, row_stride, plane)

    def launch(self, kernel, q, meta, k_cache, v_cache, inv_freq, sm_scale, plan, window):
        if kernel is Kernel.GROUPED:
            sh = meta.shared
            return self.kernels.grouped_attention_triton(
                q, meta.positions, k_cache, v_cache, meta.block_table, meta.block_pos, meta.block_delta,
                meta.block_len, inv_freq, sm_scale, sh.plan, members_per_item=sh.members_per_item,
                part_o=sh.part_o, part_lse=sh.part_lse)
        win = {} if window is None else {"window": window}  # no window: the launch without the argument
        return self.kernels.paged_attention_triton(
            q, meta.positions, meta.cu_seqlens_q, k_cache, v_cache, meta.block_table, meta.block_pos,
            meta.block_delta, meta.block_len, inv_freq, sm_scale, **win, **plan.launch, **plan.ctx)

    def rerotate_copy(self, k_cache, v_cache, src, dst, delta, inv_freq) -> None:
        self.kernels.rerotate_copy_triton(k_cache, v_cache, src, dst, delta, inv_freq)

    def mass(self, q, meta, k_cache, v_cache, inv_freq, sm_scale, *, window=None, plan=None):
        if plan is not None and plan.kernel(window) is Kernel.REFERENCE:
            return super().mass(q, meta, k_cache, v_cache, inv_freq, sm_scale, window=window)
        rope = plan.launch.get("rope") if plan is not None else None  # the step's rotation table, when planned
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
