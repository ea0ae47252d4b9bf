"""Warm-up: readiness before the first request.

Owns the driver (``warm_up``, ``Readiness``), the shapes of its synthetic requests and graph
captures (``RunnerShapes``, a collaborator given the model runner) and the count of kernels
compiled after ready (``compiles``), and the heap a warmed-up engine freezes (``heap``). It
asks the engine's parts for what they launch and runs it through the engine's public methods.
"""
from .compiles import COMPILES, default_triton_cache
from .driver import Readiness, warm_up

__all__ = ["COMPILES", "Readiness", "default_triton_cache", "warm_up"]
