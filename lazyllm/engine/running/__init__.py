"""Running: the forwards a step decided, on the device.

Owns the model runner (prefill jobs, re-rotated copies, decode launches, mixed forwards),
the device-resident decode state, the CUDA graphs, the batched sampler and the
tensor-parallel runner. It admits, frees or finishes nothing: it imports nothing of the
scheduler, the KV planner, recovery or the output.
"""
from .decode_state import DecodeState
from .model_runner import DecodeStep, ModelRunner, budget_groups
from .sampler import Sampler, TokenConstraint, top2_margins

__all__ = ["DecodeState", "DecodeStep", "ModelRunner", "Sampler", "TokenConstraint", "budget_groups", "top2_margins"]
