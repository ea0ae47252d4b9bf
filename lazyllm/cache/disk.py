"""Persistent chunk-KV tier: one safetensors file per cached segment, that cannot lie.

A file is only ever returned when everything that determines its KV matches the running
engine: the model fingerprint (architecture, weights hash, dtype, RoPE; computed by the
caller, see ``lazyllm.model.identity.fingerprint``), the chunk-context settings, the on-disk
format version, the key it was stored under, and a blake2b checksum over the metadata
and the tensor bytes. Anything else (a missing, truncated, unparsable, bit-flipped or
foreign file) is deleted, counted as a rejection and reported as a miss, so the caller
recomputes the chunk. Bad files never raise.

Files are written atomically: the bytes go to a temporary file in the same directory
(``.tmp-<pid>-<key>-<random>.part``), which is flushed and fsync'ed and then renamed
over the final name ``<key hex>.safetensors`` with ``os.replace`` (and the directory is
fsync'ed). A process killed mid-write therefore leaves at most a temporary file, which
the next ``DiskKVStore`` on that directory removes. Only safetensors is used (never
pickle or ``torch.save``), so loading a file cannot execute code.

The directory is capped at ``max_bytes``: writing evicts the least recently used files
first (recency is kept in memory and, best-effort, in each file's mtime so that it
survives a restart). One process per directory is the supported setup; several readers
are safe (every file is self-validating and renames are atomic) but each process
enforces the cap on its own view.

File layout (safetensors): tensors ``k`` and ``v``, each ``(num_layers, num_tokens,
num_kv_heads, head_dim)`` in the dtype they were given (float32, float16 or bfloat16),
and string metadata: ``format``, ``format_version``, ``library_version``,
``fingerprint``, ``settings`` (canonical JSON), ``num_tokens``, ``stored_pos``,
``dtype``, ``k_shape``, ``v_shape`` (JSON lists), ``key`` (hex) and ``checksum``
(``blake2b-256:<hex>`` over the canonical JSON of the other metadata fields, then the
bytes of ``k``, then of ``v``, each length-prefixed).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import struct
import threading
import time
from collections import OrderedDict

import safetensors.torch
import torch

log = logging.getLogger(__name__)

FORMAT_NAME = "lazyllm-kv"
FORMAT_VERSION = 1
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
TMP_SUFFIX = ".part"
MAX_KEY_BYTES = 64  # 128 hex characters: well under every file system's name limit
STALE_TMP_S = 3600.0  # a temp file this old is stale even if its pid looks alive

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
REJECT_REASONS = ("missing", "unreadable", "too_large", "truncated", "unparsable", "version",
                  "checksum", "key", "fingerprint", "settings", "inconsistent")

_FINAL_RE = re.compile(rf"^([0-9a-f]{{2,{2 * MAX_KEY_BYTES}}}){re.escape(SUFFIX)}$")
_TMP_RE = re.compile(rf"^{re.escape(TMP_PREFIX)}(\d+)-")


def _library_version() -> str:
    try:
        from importlib.metadata import version
        return version("lazyattention")
    except Exception:
        import sys
        return str(getattr(sys.modules.get("lazyllm"), "__version__", "unknown"))


def _tensor_bytes(t: torch.Tensor):
    return t.contiguous().view(-1).view(torch.uint8).numpy()


def _checksum(meta: dict, k: torch.Tensor, v: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=32)
    body = json.dumps({a: b for a, b in meta.items() if a != "checksum"}, sort_keys=True,
                      separators=(",", ":")).encode()
    h.update(struct.pack("<Q", len(body)))
    h.update(body)
    for t in (k, v):
        b = _tensor_bytes(t)
        h.update(struct.pack("<Q", b.nbytes))
        h.update(b)
    return "blake2b-256:" + h.hexdigest()


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return False
    return True


class _Reject(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class DiskKVStore:
    """Persistent, size-capped, self-validating store of chunk KV (see the module doc).

    Parameters
    ----------
    directory : created if missing (mode 0o700; files are written 0o600, since KV
        reveals the documents it was computed from).
    max_bytes : cap on the total size of the files; least recently used files are
        deleted to stay under it.
    fingerprint : identity of the model (``lazyllm.model.identity.fingerprint``).
    settings : JSON-serialisable dict of everything else the KV depends on, e.g.
        ``{"chunk_context": "isolated"}``. A file written under other settings is
        rejected. (The files hold per-token KV, not pages, so the page size does not
        change them; include it only if you want files to be dropped when it changes.)

    Thread-safe: every method may be called from any thread. File I/O happens outside
    the lock; the index, the counters and deletions are under it.
    """

    WRITE_CHUNK = 1 << 20  # bytes per os.write call

    def __init__(self, directory, max_bytes: int, *, fingerprint: str, settings: dict):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise ValueError("fingerprint must be a non-empty string")
        if not isinstance(settings, dict):
            raise ValueError(f"settings must be a dict, got {type(settings).__name__}")
        try:
            self._settings_json = json.dumps(settings, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"settings must be JSON-serialisable: {e}") from None
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self.settings = json.loads(self._settings_json)
        self._library_version = _library_version()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key hex -> file size, LRU first
        self._bytes = 0
        self._hits = self._misses = self._writes = self._write_failures = 0
        self._too_large = self._evictions = self._stale_tmp_removed = 0
        self._rejections = dict.fromkeys(REJECT_REASONS, 0)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._scan()

    # -- public ---------------------------------------------------------------------
    def put(self, key: bytes, k: torch.Tensor, v: torch.Tensor, *, num_tokens: int, stored_pos: int) -> bool:
        """Store the KV of one cached segment under ``key``.

        ``k`` and ``v``: ``(num_layers, num_tokens, num_kv_heads, head_dim)``, same shape,
        same dtype (float32, float16 or bfloat16); they are copied to the CPU if needed.
        ``stored_pos``: the position of the segment's first token when it was computed.
        Replaces an existing file for the same key. Returns False, and leaves no file, if
        the entry alone exceeds ``max_bytes`` or the write fails (disk full, I/O error).
        Raises ``ValueError``/``TypeError`` for malformed arguments.
        """
        hexkey = self._hex(key)
        k, v = self._check_tensors(k, v, num_tokens)
        if not isinstance(stored_pos, int) or isinstance(stored_pos, bool) or stored_pos < 0:
            raise ValueError(f"stored_pos must be an int >= 0, got {stored_pos!r}")
        meta = {
            "format": FORMAT_NAME,
            "format_version": str(FORMAT_VERSION),
            "library_version": self._library_version,
            "fingerprint": self.fingerprint,
            "settings": self._settings_json,
            "num_tokens": str(num_tokens),
            "stored_pos": str(stored_pos),
            "dtype": DTYPES[k.dtype],
            "k_shape": json.dumps(list(k.shape)),
            "v_shape": json.dumps(list(v.shape)),
            "key": hexkey,
        }
        meta["checksum"] = _checksum(meta, k, v)
        data = safetensors.torch.save({"k": k, "v": v}, metadata=meta)
        size = len(data)
        if size > self.max_bytes:
            with self._lock:
                self._too_large += 1
            return False
        final = self._path(hexkey)
        tmp = os.path.join(self.directory, f"{TMP_PREFIX}{os.getpid()}-{hexkey}-{secrets.token_hex(4)}{TMP_SUFFIX}")
        try:
            self._write_file(tmp, data)
            del data
            with self._lock:
                self._make_room(size - self._index.get(hexkey, 0), exclude=hexkey)
                os.replace(tmp, final)
                old = self._index.pop(hexkey, None)
                self._bytes += size - (old or 0)
                self._index[hexkey] = size
                self._writes += 1
            self._fsync_dir()
            return True
        except OSError as e:
            log.warning("disk KV tier: writing %s failed: %s", final, e)
            with self._lock:
                self._write_failures += 1
            return False
        finally:
            # the temp file is gone after a successful rename; after any failure (or an
            # exception such as KeyboardInterrupt) remove what was written of it
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def get(self, key: bytes):
        """``(k, v, num_tokens, stored_pos)`` stored under ``key`` (CPU tensors, in their
        stored dtype and shape ``(num_layers, num_tokens, num_kv_heads, head_dim)``), or
        ``None`` if there is no valid file. An invalid file is deleted and counted in
        ``stats()["rejections"]`` by reason; ``None`` is also a miss."""
        hexkey = self._hex(key)
        path = self._path(hexkey)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size > self.max_bytes:
                    raise _Reject("too_large")
                data = f.read()
        except FileNotFoundError:
            with self._lock:
                # indexed, yet gone: deleted behind our back (our own deletions hold the lock
                # and drop the index entry; a concurrent put may have renamed it in since)
                if hexkey in self._index and not os.path.exists(path):
                    del self._index[hexkey]
                    self._recount()
                    self._rejections["missing"] += 1
                self._misses += 1
            return None
        except _Reject as r:
            self._reject(hexkey, path, st, r.reason)
            return None
        except OSError as e:
            log.warning("disk KV tier: reading %s failed: %s", path, e)
            self._reject(hexkey, path, None, "unreadable")
            return None
        try:
            out = self._decode(hexkey, data)
        except _Reject as r:
            self._reject(hexkey, path, st, r.reason)
            return None
        except Exception as e:  # never raise on a bad file
            log.warning("disk KV tier: %s: unexpected error while validating: %r", path, e)
            self._reject(hexkey, path, st, "unparsable")
            return None
        del data
        with self._lock:
            self._hits += 1
            if hexkey in self._index:
                self._index.move_to_end(hexkey)
                if self._index[hexkey] != st.st_size and self._same_file(path, st):
                    self._index[hexkey] = st.st_size  # replaced by another process
                    self._recount()
                    self._make_room(0, exclude=hexkey)
            elif self._same_file(path, st):
                # written by another process (or an earlier instance) after our scan
                self._index[hexkey] = st.st_size
                self._bytes += st.st_size
                self._make_room(0, exclude=hexkey)
            # else: evicted or replaced while we read it; what we read was valid all the same
        with contextlib.suppress(OSError):
            os.utime(path)  # recency survives a restart (best effort)
        return out

    def __contains__(self, key: bytes) -> bool:
        """Whether a file is indexed for ``key`` (not validated: ``get`` may still reject it)."""
        hexkey = self._hex(key)
        with self._lock:
            return hexkey in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def clear(self) -> int:
        """Delete every file of the store; returns how many."""
        with self._lock:
            keys = list(self._index)
            for h in keys:
                self._unlink(self._path(h))
            self._index.clear()
            self._bytes = 0
            return len(keys)

    def stats(self) -> dict:
        """Files and bytes on disk, hits and misses of ``get`` (a rejection is also a
        miss), rejections by reason, evictions, writes and failed writes."""
        with self._lock:
            return {
                "directory": self.directory,
                "max_bytes": self.max_bytes,
                "files": len(self._index),
                "bytes": self._bytes,
                "hits": self._hits,
                "misses": self._misses,
                "rejections": dict(self._rejections),
                "rejected": sum(self._rejections.values()),
                "evictions": self._evictions,
                "writes": self._writes,
                "write_failures": self._write_failures,
                "skipped_too_large": self._too_large,
                "stale_tmp_removed": self._stale_tmp_removed,
            }

    # -- internals ---------------------------------------------------------------------
    def _path(self, hexkey: str) -> str:
        return os.path.join(self.directory, hexkey + SUFFIX)

    @staticmethod
    def _hex(key) -> str:
        if not isinstance(key, (bytes, bytearray)):
            raise TypeError(f"key must be bytes, got {type(key).__name__}")
        if not 1 <= len(key) <= MAX_KEY_BYTES:
            raise ValueError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
        return bytes(key).hex()

    @staticmethod
    def _check_tensors(k, v, num_tokens):
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise TypeError("k and v must be torch tensors")
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape (num_layers, num_tokens, num_kv_heads, "
                             f"head_dim), got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != v.dtype or k.dtype not in DTYPES:
            raise ValueError(f"k and v must share a dtype among {list(DTYPES.values())}, got {k.dtype} and {v.dtype}")
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1 \
                or k.shape[1] != num_tokens:
            raise ValueError(f"num_tokens ({num_tokens!r}) must be >= 1 and equal k.shape[1] ({k.shape[1]})")
        return k.detach().to("cpu").contiguous(), v.detach().to("cpu").contiguous()

    def _write_chunk(self, fd: int, chunk: memoryview) -> None:
        while chunk:
            n = os.write(fd, chunk)
            chunk = chunk[n:]

    def _write_file(self, tmp: str, data: bytes) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            view = memoryview(data)
            for off in range(0, len(view), self.WRITE_CHUNK):
                self._write_chunk(fd, view[off:off + self.WRITE_CHUNK])
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fsync_dir(self) -> None:
        try:
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)

    def _decode(self, hexkey: str, data: bytes):
        """Validate a file's bytes; raise ``_Reject(reason)`` or return the entry."""
        if len(data) < 8:
            raise _Reject("truncated")
        n = struct.unpack("<Q", data[:8])[0]
        if n > len(data) - 8:
            raise _Reject("truncated")
        try:
            header = json.loads(data[8:8 + n])
            meta = header.pop("__metadata__")
            end = max(int(t["data_offsets"][1]) for t in header.values())
        except Exception:
            raise _Reject("unparsable") from None
        if len(data) < 8 + n + end:
            raise _Reject("truncated")
        try:
            tensors = safetensors.torch.load(data)
        except Exception:
            raise _Reject("unparsable") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME or set(tensors) != {"k", "v"}:
            raise _Reject("unparsable")
        if meta.get("format_version") != str(FORMAT_VERSION):
            raise _Reject("version")
        k, v = tensors["k"], tensors["v"]
        if meta.get("checksum") != _checksum(meta, k, v):
            raise _Reject("checksum")
        if meta.get("key") != hexkey:
            raise _Reject("key")
        if meta.get("fingerprint") != self.fingerprint:
            raise _Reject("fingerprint")
        if meta.get("settings") != self._settings_json:
            raise _Reject("settings")
        try:
            num_tokens, stored_pos = int(meta["num_tokens"]), int(meta["stored_pos"])
            ok = (meta["dtype"] == DTYPES.get(k.dtype) and k.dtype == v.dtype
                  and json.loads(meta["k_shape"]) == list(k.shape) == json.loads(meta["v_shape"]) == list(v.shape)
                  and k.dim() == 4 and k.shape[1] == num_tokens >= 1 and stored_pos >= 0)
        except Exception:
            ok = False
        if not ok:  # checksummed, so only a writer bug gets here
            raise _Reject("inconsistent")
        return k, v, num_tokens, stored_pos

    def _reject(self, hexkey: str, path: str, st, reason: str) -> None:
        with self._lock:
            # delete the file we judged, not one that a concurrent put renamed over it since
            if st is None or self._same_file(path, st):
                self._unlink(path)
                if self._index.pop(hexkey, None) is not None:
                    self._recount()
            self._rejections[reason] += 1
            self._misses += 1
        log.warning("disk KV tier: rejected %s (%s)", path, reason)

    @staticmethod
    def _same_file(path: str, st) -> bool:
        try:
            cur = os.stat(path)
        except OSError:
            return False
        ident = lambda s: (s.st_ino, s.st_dev, s.st_size, s.st_mtime_ns)  # noqa: E731
        return ident(cur) == ident(st)

    def _make_room(self, size: int, exclude: str) -> None:
        """Evict LRU files until ``size`` more bytes fit (lock held)."""
        for h in list(self._index):
            if self._bytes + size <= self.max_bytes:
                break
            if h == exclude:
                continue
            self._bytes -= self._index.pop(h)
            self._unlink(self._path(h))
            self._evictions += 1

    def _recount(self) -> None:
        self._bytes = sum(self._index.values())

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("disk KV tier: cannot delete %s: %s", path, e)

    def _scan(self) -> None:
        """Index existing files (oldest mtime first), remove stale temp files, enforce the cap."""
        found = []
        now = time.time()
        with os.scandir(self.directory) as it:
            for de in it:
                name = de.name
                try:
                    if name.startswith(TMP_PREFIX):
                        m = _TMP_RE.match(name)
                        st = de.stat(follow_symlinks=False)
                        mine_or_alive = m is not None and _pid_alive(int(m.group(1)))
                        if not mine_or_alive or now - st.st_mtime > STALE_TMP_S:
                            self._unlink(de.path)
                            self._stale_tmp_removed += 1
                        continue
                    m = _FINAL_RE.match(name)
                    if m is None or not de.is_file(follow_symlinks=False):
                        continue
                    st = de.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, name, m.group(1), st.st_size))
                except OSError:
                    continue
        for _, _, hexkey, size in sorted(found):
            self._index[hexkey] = size
        self._recount()
        with self._lock:
            self._make_room(0, exclude="")
