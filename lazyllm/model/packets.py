"""Learned chunk packets: a few trained input embeddings placed around every chunk while its
KV is computed (docs/design.md, "Learned chunk packets").

A packet is ``k_header`` embeddings that take the positions just before a chunk's first token
(the chunk attends to them as to a preceding context) and ``k_trailer`` embeddings right after
its last token (they attend to the chunk). Under deferred RoPE they are ordinary chunk content:
their KV is stored with the chunk and moved with it, so reuse stays zero-copy and
position-independent. The model's weights are frozen; only the ``(k, hidden)`` values train
(``lazyllm.quality.adapt``).

In a token sequence a packet embedding is a *virtual token id* at or above the model's
embedding rows (``base``): ``base + j`` is packet row ``j`` (header rows first, then the
trailer's). The model's embedding lookup maps those ids to the packet rows, so the rest of the
engine (pages, positions, keys, recompute) handles a packet like any chunk token.

A *bridge* packet (``bridge=True``) has a trailer that is recomputed for every request: the
engine caches the chunk with its header and trailer as above, then recomputes the trailer's
KV with attention over the prefix, every earlier chunk (and their bridges) and its own
chunk, for that request only (quality recovery's recompute path). The bridge then carries
how this chunk relates to the others, which a cached trailer cannot; the chunk bodies stay
cached, isolated and shared. It costs ``k_trailer`` recomputed tokens per chunk per request.

File format: safetensors with tensors ``header`` ``(k_header, hidden)`` and ``trailer``
``(k_trailer, hidden)`` (float32, in the space of the embedding table's rows, before any
embedding scale the model applies) and string metadata ``format`` (``"lazyllm-packets"``),
``version``, ``model`` (``lazyllm.model.identity.model_id`` of the model it was trained for), ``k_header``,
``k_trailer``, ``hidden_size``, ``bridge`` (``"1"`` for a bridge packet; absent or ``"0"``
otherwise) and free-form ``info`` (JSON: how it was trained).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import InvalidRequestError
from .identity import model_id

FORMAT = "lazyllm-packets"
VERSION = 1


@dataclass(frozen=True, eq=False)
class Packets:
    """A trained packet for one model.

    header : ``(k_header, hidden)`` float32, may have ``k_header == 0``.
    trailer : ``(k_trailer, hidden)`` float32, may have ``k_trailer == 0``.
    model : ``lazyllm.model.identity.model_id`` of the model the packet was trained for.
    info : free-form description (training data, steps, loss), stored in the file.
    bridge : the trailer is recomputed per request (see the module docstring).
    """

    header: torch.Tensor
    trailer: torch.Tensor
    model: str
    info: dict = field(default_factory=dict)
    bridge: bool = False

    def __post_init__(self):
        h, t = self.header, self.trailer
        if h.dim() != 2 or t.dim() != 2 or h.shape[1] != t.shape[1]:
            raise InvalidRequestError(f"packet header {tuple(h.shape)} and trailer {tuple(t.shape)} must be "
                                      "(k, hidden) with the same hidden size")
        if h.shape[0] + t.shape[0] == 0:
            raise InvalidRequestError("a packet needs at least one header or trailer embedding")
        if not (torch.isfinite(h).all() and torch.isfinite(t).all()):
            raise InvalidRequestError("packet embeddings must be finite")
        if self.bridge and t.shape[0] == 0:
            raise InvalidRequestError("a bridge packet needs at least one trailer embedding")

    @property
    def k_header(self) -> int:
        return int(self.header.shape[0])

    @property
    def k_trailer(self) -> int:
        return int(self.trailer.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.header.shape[1])

    @property
    def rows(self) -> torch.Tensor:
        """``(k_header + k_trailer, hidden)``: the rows virtual ids ``base + j`` index."""
        return torch.cat([self.header, self.trailer]).float()

    @property
    def bridge_tokens(self) -> int:
        """Trailer tokens recomputed per request (``k_trailer`` for a bridge packet, else 0)."""
        return self.k_trailer if self.bridge else 0

    @property
    def digest(self) -> str:
        """Hash of the packet's values, sizes, kind and model: part of every chunk key it touches."""
        h = hashlib.blake2b(digest_size=12)
        kind = ":bridge" if self.bridge else ""
        h.update(f"{FORMAT}:{VERSION}:{self.model}:{self.k_header}:{self.k_trailer}{kind}".encode())
        h.update(self.rows.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()

    def ids(self, base: int) -> tuple[list[int], list[int]]:
        """Virtual token ids of the header and of the trailer for a model whose embedding
        table has ``base`` rows."""
        return (list(range(base, base + self.k_header)),
                list(range(base + self.k_header, base + self.k_header + self.k_trailer)))

    def save(self, path: str | os.PathLike) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(format=FORMAT, version=str(VERSION), model=self.model, k_header=str(self.k_header),
                    k_trailer=str(self.k_trailer), hidden_size=str(self.hidden_size), bridge=str(int(self.bridge)),
                    info=json.dumps(self.info))
        tmp = path.with_name(path.name + ".tmp")
        save_file({"header": self.header.detach().float().contiguous().cpu(),
                   "trailer": self.trailer.detach().float().contiguous().cpu()}, str(tmp), metadata=meta)
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors writes 0600; a packet is shared like any model file
        os.replace(tmp, path)
        return path

    def __repr__(self) -> str:
        return (f"Packets(k_header={self.k_header}, k_trailer={self.k_trailer}, hidden={self.hidden_size}, "
                f"bridge={self.bridge}, digest={self.digest})")


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it
    os.umask(mask)
    return mask


def load_packets(path: str | os.PathLike) -> Packets:
    """Read a packet file (see the module docstring); a file that is not one raises
    ``InvalidRequestError``."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise InvalidRequestError(f"packet file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise InvalidRequestError(f"{str(path)!r} is not a safetensors packet file: {e}") from None
    if meta.get("format") != FORMAT or "header" not in tensors or "trailer" not in tensors:
        raise InvalidRequestError(f"{str(path)!r} is not a lazyllm packet file (format {meta.get('format')!r})")
    if int(meta.get("version", -1)) > VERSION:
        raise InvalidRequestError(f"{str(path)!r} has packet format version {meta.get('version')}; this lazyllm "
                                  f"reads up to {VERSION}")
    if meta.get("bridge", "0") not in ("0", "1"):
        raise InvalidRequestError(f"{str(path)!r}: metadata bridge={meta.get('bridge')!r}, expected '0' or '1'")
    p = Packets(tensors["header"].float(), tensors["trailer"].float(), meta.get("model", ""),
                json.loads(meta.get("info", "{}") or "{}"), bridge=meta.get("bridge", "0") == "1")
    declared = (meta.get("k_header"), meta.get("k_trailer"), meta.get("hidden_size"))
    if declared != (str(p.k_header), str(p.k_trailer), str(p.hidden_size)):
        raise InvalidRequestError(f"{str(path)!r}: metadata sizes {declared} disagree with its tensors")
    return p


def as_packets(value) -> Packets | None:
    """``None``, a ``Packets`` or a path to a packet file, as ``Packets``."""
    if value is None or isinstance(value, Packets):
        return value
    if isinstance(value, (str, os.PathLike)):
        return load_packets(value)
    raise InvalidRequestError(f"packets must be a path, a lazyllm Packets or None, got {type(value).__name__}")


# packets shipped in the package (trained with ``lazyllm adapt``), found by their model id
SHIPPED_DIR = Path(__file__).with_name("packet_files")


def shipped_packets(model, chunk_context: str, name: str | None = None) -> Packets | None:
    """The packet shipped for ``model`` (a ``LlamaFamilyModel``) and trained under
    ``chunk_context``, or ``None``. ``name`` picks a variant by file stem; ``None`` takes the
    one whose metadata says ``"default": true``."""
    if not SHIPPED_DIR.is_dir():
        return None
    mine = None
    for path in sorted(SHIPPED_DIR.glob("*.safetensors")):
        if name is not None and path.stem != name:
            continue
        p = load_packets(path)
        mine = mine or model_id(model)
        if p.model == mine and p.info.get("chunk_context", "isolated") == chunk_context \
                and (name is not None or p.info.get("default")):
            return p
    return None


def check_packets_for(p: Packets, model) -> None:
    """Raise ``InvalidRequestError`` unless ``p`` was trained for ``model`` (a
    ``LlamaFamilyModel``)."""
    if p.hidden_size != model.spec.hidden_size:
        raise InvalidRequestError(f"the packet has hidden size {p.hidden_size}, the model {model.spec.hidden_size}")
    mine = model_id(model)
    if p.model != mine:
        raise InvalidRequestError(f"the packet was trained for another model (fingerprint {p.model[:12]}..., this "
                                  f"model's is {mine[:12]}...): train one for this model with `lazyllm adapt`")


__all__ = ["Packets", "load_packets", "as_packets", "check_packets_for", "shipped_packets",
           "FORMAT", "VERSION", "SHIPPED_DIR"]


def resolve_packets(packets, model, chunk_context: str, *, auto: bool) -> Packets | None:
    """The ``Packets`` an engine places around chunks (``None``: none), checked against the
    model (``EngineConfig`` checked them against the other options) and installed in the
    model's embedding lookup. ``packets="auto"`` takes the packet shipped for this model and
    chunk context where ``auto`` allows it (the modes that cache chunk KV)."""
    if isinstance(packets, str) and packets == "auto":
        p = shipped_packets(model, chunk_context) if auto else None
    else:
        p = as_packets(packets)
        if p is not None:
            check_packets_for(p, model)
    model.set_packets(p.rows if p is not None else None)
    return p
