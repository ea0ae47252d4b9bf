"""Tensor parallelism inside one replica: the worker processes and rank 0's model runner.

The caller's process is rank 0 and runs the whole engine (scheduler, planner, output) as
without tensor parallelism; its model is the lead ``TensorParallelModel``, which broadcasts
every forward's inputs (token ids, attention metadata, logit rows) before running its shard.
``TensorParallelRunner`` broadcasts the re-rotated page copies likewise. Ranks 1..N-1 are
processes started here (``torch.multiprocessing``, spawn), one per GPU (or CPU processes over
gloo): each keeps its shard of the weights and a page pool of the same page count for its own
KV heads, and runs what rank 0 sends until ``close()``.

Each process starts with NVLink multicast off (``MULTICAST_OFF_ENV``).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ...cache.store import PagePool
from ...errors import InvalidRequestError
from ...model.attention import make_backend
from ...model.tensor_parallel import (
    COPY,
    FORWARD,
    MULTICAST_OFF_ENV,
    POOL,
    STOP,
    TensorParallelModel,
    tensor_parallel_error,
)
from ..metrics import EngineMetrics
from .model_runner import ModelRunner

START_TIMEOUT_S = 600.0


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: the forwards broadcast through the lead model; copies here."""

    supports_shared = False  # the broadcast metadata carries no shared-chunk plan
    supports_mixed = False  # nor mixed steps: they run in one process

    def copy_pages(self, copies: list[tuple[int, int, int]]) -> None:
        if not copies:
            return
        m = self.model
        if m.broken:
            raise RuntimeError(f"the tensor-parallel group is broken ({m.broken}); make a new LazyLLM")
        try:
            m.channel.send_copy(copies)
            super().copy_pages(copies)
        except BaseException as e:
            m.broken = f"{type(e).__name__}: {e}"
            raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_devices(device: torch.device, n: int) -> list[torch.device]:
    """The device of each rank: rank 0 on ``device``, the others on the next GPUs (CPU: all
    on the CPU)."""
    if device.type != "cuda":
        return [device] * n
    first = device.index if device.index is not None else torch.cuda.current_device()
    others = [i for i in range(torch.cuda.device_count()) if i != first]
    return [torch.device("cuda", first)] + [torch.device("cuda", i) for i in others[:n - 1]]


class TensorParallelGroup:
    """Rank 0's handle on the process group and its worker processes.

    ``source``: the transformers model to shard (CPU tensors travel through shared memory,
    CUDA tensors through CUDA IPC), or ``("load", path, trust_remote_code)`` for each worker
    to load the checkpoint itself (on the CPU, then its shard to its GPU).
    """

    def __init__(self, n: int, device: torch.device, dtype: torch.dtype, source, *, attention_backend: str,
                 batch_invariant: bool, kernel_options=None):
        self.n = n
        self.devices = rank_devices(device, n)
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.procs: list = []
        self.model: TensorParallelModel | None = None
        self._closed = False
        os.environ.update(MULTICAST_OFF_ENV)  # this process joins the group too
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel starts its own torch.distributed process group; "
                               "this process already has one")
        ctx = mp.get_context("spawn")
        self._status = ctx.Queue()
        port = _free_port()
        timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, n, is_master=True, timeout=timeout, wait_for_workers=False)
        args = dict(world=n, port=port, backend=self.backend, dtype=dtype, source=source,
                    attention_backend=attention_backend, batch_invariant=batch_invariant,
                    kernel_options=kernel_options)
        for r in range(1, n):
            p = ctx.Process(target=_worker_main, args=(r, str(self.devices[r]), args, self._status), daemon=True,
                            name=f"lazyllm-tp{r}")
            p.start()
            self.procs.append(p)
        # every worker up and about to join before this process blocks in the rendezvous
        # (a worker that dies on its way, e.g. when re-importing the caller's main module
        # fails, is reported instead of waited for)
        deadline = time.monotonic() + START_TIMEOUT_S
        for r, p in enumerate(self.procs, 1):
            while not store.check([f"lazyllm-tp-up{r}"]):
                if not p.is_alive() or time.monotonic() > deadline:
                    self._stop_procs()
                    raise RuntimeError(f"tensor_parallel worker {r} did not start (exit code {p.exitcode}); "
                                       "the workers are spawned and re-import the main module: guard a script's "
                                       "work with `if __name__ == '__main__':`")
                time.sleep(0.05)
        dist.init_process_group(self.backend, store=store, rank=0, world_size=n, timeout=timeout,
                                device_id=self.devices[0] if device.type == "cuda" else None)
        self._store = store

    def shard(self, hf_model, attention, batch_invariant: bool) -> TensorParallelModel:
        """Rank 0's shard (the lead), once every worker has its own."""
        self.model = TensorParallelModel(hf_model, rank=0, world=self.n, device=self.devices[0],
                                         attention=attention, batch_invariant=batch_invariant)
        waiting = set(range(1, self.n))
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            try:
                rank, err = self._status.get(timeout=1.0)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"tensor_parallel workers did not start: {dead or 'timed out'}") from None
                continue
            if err is not None:
                raise RuntimeError(f"tensor_parallel rank {rank} failed to start: {err}")
            waiting.discard(rank)
        return self.model

    def start_pools(self, pool: PagePool) -> None:
        """Each worker makes its page pool: the same page count and size as ``pool``."""
        self.model.channel.send_pool(pool.num_pages, pool.page_size)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the workers (after the engine thread has stopped) and leave the group."""
        if self._closed:
            return
        self._closed = True
        stopped = False
        if self.model is not None and not self.model.broken and all(p.is_alive() for p in self.procs):
            with contextlib.suppress(Exception):  # a worker gone: terminated below
                self.model.channel.send_stop()
                stopped = True
        # workers that were not told to stop (a broken group) are terminated at once
        self._stop_procs(timeout if stopped else 0.5)
        if dist.is_initialized():
            dist.destroy_process_group()

    def _stop_procs(self, timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def check_group(n: int, cfg, device: torch.device) -> None:
    """Raise ``InvalidRequestError`` where ``n`` ranks cannot shard a model of config ``cfg``
    (heads, KV heads, MLP size) or exceed the GPUs present."""
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    err = tensor_parallel_error(n, heads, kv, cfg.intermediate_size)
    if err:
        raise InvalidRequestError(err)
    if device.type == "cuda" and n > torch.cuda.device_count():
        raise InvalidRequestError(f"tensor_parallel={n} needs {n} GPUs; {torch.cuda.device_count()} present")


def start_group(n: int, hf, source, backend, device: torch.device, dtype: torch.dtype, *, attention_backend: str,
                batch_invariant: bool, kernel_options, live) -> tuple[TensorParallelGroup, TensorParallelModel]:
    """Start the group of ``n`` ranks (``check_group`` first: the workers are not checked
    again), add it to ``live`` (a set of groups stopped at exit) and return it with rank 0's
    shard of ``hf``; the workers are stopped again if sharding fails."""
    group = TensorParallelGroup(n, device, dtype, source, attention_backend=attention_backend,
                                batch_invariant=batch_invariant, kernel_options=kernel_options)
    live.add(group)
    try:
        return group, group.shard(hf, backend, batch_invariant)
    except BaseException:
        group.close()
        raise


def _worker_main(rank: int, device: str, a: dict, status) -> None:
    """A worker rank: join the group, shard the model, then run what rank 0 sends."""
    os.environ.update(MULTICAST_OFF_ENV)
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // a["world"]))
        timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", a["port"], a["world"], is_master=False, timeout=timeout)
        store.set(f"lazyllm-tp-up{rank}", "1")
        dist.init_process_group(a["backend"], store=store, rank=rank, world_size=a["world"], timeout=timeout,
                                device_id=dev if dev.type == "cuda" else None)
        src = a["source"]
        if isinstance(src, tuple):
            from ...model.loader import load_hf

            # on the CPU: only this rank's shard goes to its GPU
            src, _, _ = load_hf(src[1], device="cpu", dtype=a["dtype"], trust_remote_code=src[2], progress=False)
        backend = make_backend(a["attention_backend"], dev, batch_invariant=a["batch_invariant"],
                               options=a["kernel_options"])
        model = TensorParallelModel(src, rank=rank, world=a["world"], device=dev, attention=backend,
                                    batch_invariant=a["batch_invariant"])
        del src
    except BaseException as e:
        status.put((rank, f"{type(e).__name__}: {e}"))
        return
    status.put((rank, None))
    try:
        _serve(model, backend)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _serve(model: TensorParallelModel, backend) -> None:
    ch = model.channel
    runner = pool = None
    while True:
        h = ch.recv()
        cmd = h[0]
        if cmd == FORWARD:
            ids, meta, rows = ch.recv_forward(h)
            model.forward(ids, meta, pool.k, pool.v, logits_index=rows)
        elif cmd == COPY:
            runner.copy_pages(ch.recv_copy(h))
        elif cmd == POOL:
            s = model.spec
            pool = PagePool(s.num_layers, s.num_kv_heads, s.head_dim, page_size=h[2], num_pages=h[1],
                            dtype=model.dtype, device=model.device)
            runner = ModelRunner(model, pool, rerotate_copy=backend.rerotate_copy, max_batch_tokens=1,
                                 max_batch_size=1, cuda_graphs=False, metrics=EngineMetrics())
        elif cmd == STOP:
            return
        else:
            raise RuntimeError(f"tensor_parallel worker: unknown command {cmd}")
