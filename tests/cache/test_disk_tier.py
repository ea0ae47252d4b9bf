"""Persistent chunk-KV tier (lazyllm/cache/disk.py): round trips, every way a file can lie,
crashes mid-write, the size cap, restarts and concurrent use."""
import contextlib
import json
import logging
import os
import pickle
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch

from lazyllm.cache import disk as disk_mod
from lazyllm.cache.disk import DiskKVStore

REPO = Path(__file__).resolve().parents[2]
FP = "fp-model-a"
SETTINGS = {"chunk_context": "isolated", "format_version": 1}


@pytest.fixture(autouse=True)
def _quiet(caplog):
    # rejections log a warning each; thousands of them (bit-flip sweep) would slow pytest down
    caplog.set_level(logging.ERROR, logger="lazyllm.cache.disk")


def _store(d, max_bytes=1 << 26, fingerprint=FP, settings=SETTINGS):
    return DiskKVStore(d, max_bytes, fingerprint=fingerprint, settings=settings)


def _kv(seed=0, layers=2, tokens=5, heads=2, dim=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, tokens, heads, dim, generator=g).to(dtype)
    v = torch.randn(layers, tokens, heads, dim, generator=g).to(dtype)
    return k, v


def _bits(t):
    return t.contiguous().view(-1).view(torch.uint8)


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _file(store, key):
    return Path(store.directory) / (key.hex() + ".safetensors")


def _entries(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))


def _tmps(d):
    return sorted(n for n in os.listdir(d) if n.startswith(".tmp-"))


# -- round trips -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_is_bit_identical(tmp_path, dtype):
    s = _store(tmp_path)
    k, v = _kv(1, dtype=dtype)
    k[0, 0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dtype)
    assert s.put(b"\x01" * 20, k, v, num_tokens=5, stored_pos=7)
    out = s.get(b"\x01" * 20)
    assert out is not None
    k2, v2, n, pos = out
    assert _same(k2, k) and _same(v2, v) and (n, pos) == (5, 7)
    assert s.get(b"\x02" * 20) is None
    st = s.stats()
    assert (st["hits"], st["misses"], st["writes"], st["files"], st["rejected"]) == (1, 1, 1, 1, 0)
    assert st["bytes"] == os.path.getsize(_file(s, b"\x01" * 20))


def test_file_is_plain_safetensors_with_the_documented_metadata(tmp_path):
    s = _store(tmp_path)
    k, v = _kv(2, dtype=torch.bfloat16)
    s.put(b"key", k, v, num_tokens=5, stored_pos=0)
    from safetensors import safe_open
    with safe_open(str(_file(s, b"key")), framework="pt") as f:
        meta = f.metadata()
        assert set(f.keys()) == {"k", "v"}
        assert _same(f.get_tensor("k"), k)
    assert meta["format"] == "lazyllm-kv" and meta["format_version"] == "1"
    assert meta["fingerprint"] == FP and json.loads(meta["settings"]) == SETTINGS
    assert meta["key"] == b"key".hex() and meta["num_tokens"] == "5" and meta["stored_pos"] == "0"
    assert meta["dtype"] == "bfloat16" and json.loads(meta["k_shape"]) == [2, 5, 2, 8]
    assert meta["checksum"].startswith("blake2b-256:") and meta["library_version"]


def test_non_contiguous_input_and_overwrite(tmp_path):
    s = _store(tmp_path)
    base = torch.randn(2, 2, 5, 8)
    k = base.transpose(1, 2)  # (2, 5, 2, 8), not contiguous
    v = k * 2
    assert s.put(b"a", k, v, num_tokens=5, stored_pos=0)
    assert _same(s.get(b"a")[0], k.contiguous())
    k3, v3 = _kv(3)
    assert s.put(b"a", k3, v3, num_tokens=5, stored_pos=1)  # replaces
    out = s.get(b"a")
    assert _same(out[0], k3) and out[3] == 1
    assert s.stats()["files"] == 1 and _entries(tmp_path) == [b"a".hex() + ".safetensors"]


def test_invalid_arguments_raise(tmp_path):
    s = _store(tmp_path)
    k, v = _kv()
    with pytest.raises(TypeError):
        s.put("str-key", k, v, num_tokens=5, stored_pos=0)
    with pytest.raises(ValueError):
        s.put(b"", k, v, num_tokens=5, stored_pos=0)
    with pytest.raises(ValueError):
        s.put(b"k", k, v, num_tokens=4, stored_pos=0)
    with pytest.raises(ValueError):
        s.put(b"k", k, v[:, :4], num_tokens=5, stored_pos=0)
    with pytest.raises(ValueError):
        s.put(b"k", k, v.half(), num_tokens=5, stored_pos=0)
    with pytest.raises(ValueError):
        s.put(b"k", k.double(), v.double(), num_tokens=5, stored_pos=0)
    with pytest.raises(ValueError):
        s.put(b"k", k, v, num_tokens=5, stored_pos=-1)
    with pytest.raises(ValueError):
        DiskKVStore(tmp_path, 0, fingerprint=FP, settings=SETTINGS)
    with pytest.raises(ValueError):
        DiskKVStore(tmp_path, 10, fingerprint="", settings=SETTINGS)
    with pytest.raises(ValueError):
        DiskKVStore(tmp_path, 10, fingerprint=FP, settings={"x": object()})
    assert _entries(tmp_path) == [] and _tmps(tmp_path) == []


# -- files that lie ----------------------------------------------------------------------
def _assert_rejected(s, key, reason):
    before = s.stats()
    assert s.get(key) is None
    after = s.stats()
    assert after["rejections"][reason] == before["rejections"][reason] + 1, after["rejections"]
    assert after["misses"] == before["misses"] + 1
    assert not _file(s, key).exists()
    assert key not in s


@pytest.mark.parametrize("cut", ["empty", 4, 8, "mid-header", "end-of-header", "mid-data", "last-byte"])
def test_truncated_file_is_rejected_and_removed(tmp_path, cut):
    s = _store(tmp_path)
    s.put(b"t", *_kv(), num_tokens=5, stored_pos=0)
    s.put(b"other", *_kv(9), num_tokens=5, stored_pos=0)
    p = _file(s, b"t")
    data = p.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    at = {"empty": 0, "mid-header": 8 + n // 2, "end-of-header": 8 + n, "mid-data": (8 + n + len(data)) // 2,
          "last-byte": len(data) - 1}.get(cut, cut)
    p.write_bytes(data[:at])
    _assert_rejected(s, b"t", "truncated")
    assert s.get(b"other") is not None  # neighbours untouched
    assert s.stats()["files"] == 1 and s.stats()["bytes"] == os.path.getsize(_file(s, b"other"))


def test_trailing_garbage_is_rejected(tmp_path):
    s = _store(tmp_path)
    s.put(b"t", *_kv(), num_tokens=5, stored_pos=0)
    with open(_file(s, b"t"), "ab") as f:
        f.write(b"\0")
    _assert_rejected(s, b"t", "unparsable")


def test_bit_flip_in_tensor_data_is_rejected(tmp_path):
    s = _store(tmp_path)
    s.put(b"t", *_kv(dtype=torch.float16), num_tokens=5, stored_pos=0)
    p = _file(s, b"t")
    data = bytearray(p.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    data[8 + n + 37] ^= 0x04  # one bit of one element of k
    p.write_bytes(bytes(data))
    _assert_rejected(s, b"t", "checksum")


def test_bit_flip_in_header_metadata_is_rejected(tmp_path):
    s = _store(tmp_path)
    s.put(b"t", *_kv(), num_tokens=5, stored_pos=3)
    p = _file(s, b"t")
    data = bytearray(p.read_bytes())
    i = data.index(b'"stored_pos":"3"') + len(b'"stored_pos":"')
    data[i] ^= 0x01  # "3" -> "2": still valid JSON and a valid position, but a lie
    p.write_bytes(bytes(data))
    _assert_rejected(s, b"t", "checksum")


def test_every_single_bit_flip_anywhere_in_the_file_is_rejected(tmp_path):
    """Exhaustive: no single-bit corruption of a (small) file is ever served."""
    s = _store(tmp_path)
    key = b"\xab" * 20
    s.put(key, *_kv(layers=1, tokens=2, heads=1, dim=4, dtype=torch.float16), num_tokens=2, stored_pos=0)
    p = _file(s, key)
    good = p.read_bytes()
    served = []
    for i in range(len(good)):
        for b in range(8):
            bad = bytearray(good)
            bad[i] ^= 1 << b
            p.write_bytes(bad)
            if s.get(key) is not None:
                served.append((i, b))
            assert not p.exists()
    assert served == []
    rej = s.stats()["rejections"]
    assert sum(rej.values()) == 8 * len(good)
    assert rej["checksum"] > 0 and rej["unparsable"] > 0 and rej["truncated"] > 0
    p.write_bytes(good)
    assert s.get(key) is not None


def test_wrong_model_fingerprint_is_rejected(tmp_path):
    _store(tmp_path, fingerprint="fp-model-b").put(b"t", *_kv(), num_tokens=5, stored_pos=0)
    s = _store(tmp_path)
    assert b"t" in s  # indexed at startup, judged on read
    _assert_rejected(s, b"t", "fingerprint")


def test_wrong_settings_are_rejected(tmp_path):
    _store(tmp_path, settings={**SETTINGS, "chunk_context": "prefix"}).put(b"t", *_kv(), num_tokens=5, stored_pos=0)
    s = _store(tmp_path)
    _assert_rejected(s, b"t", "settings")
    # same settings in another key order are the same settings
    _store(tmp_path, settings=dict(reversed(list(SETTINGS.items())))).put(b"u", *_kv(), num_tokens=5, stored_pos=0)
    assert s.get(b"u") is not None


def test_wrong_format_version_is_rejected(tmp_path, monkeypatch):
    old = _store(tmp_path)
    monkeypatch.setattr(disk_mod, "FORMAT_VERSION", 2)
    old.put(b"t", *_kv(), num_tokens=5, stored_pos=0)
    monkeypatch.setattr(disk_mod, "FORMAT_VERSION", 1)
    _assert_rejected(_store(tmp_path), b"t", "version")


def test_file_renamed_to_another_key_is_rejected(tmp_path):
    s = _store(tmp_path)
    s.put(b"a", *_kv(), num_tokens=5, stored_pos=0)
    os.replace(_file(s, b"a"), _file(s, b"b"))
    _assert_rejected(s, b"b", "key")


def test_foreign_files_are_rejected_and_pickle_never_runs(tmp_path):
    s = _store(tmp_path)
    # a plain safetensors file without our metadata
    _file(s, b"w").write_bytes(safetensors.torch.save({"k": torch.zeros(1, 1, 1, 1), "v": torch.zeros(1, 1, 1, 1)}))
    _assert_rejected(s, b"w", "unparsable")
    # a pickle whose loading would create a marker file
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    _file(s, b"p").write_bytes(pickle.dumps(Evil()))
    _assert_rejected(s, b"p", "truncated")
    assert not marker.exists()
    # random bytes
    _file(s, b"r").write_bytes(os.urandom(4096))
    assert s.get(b"r") is None and not _file(s, b"r").exists()


def test_file_deleted_behind_the_store_is_a_miss(tmp_path):
    s = _store(tmp_path)
    s.put(b"a", *_kv(), num_tokens=5, stored_pos=0)
    _file(s, b"a").unlink()
    _assert_rejected(s, b"a", "missing")
    assert s.stats()["bytes"] == 0


# -- crashes mid-write ---------------------------------------------------------------------
class _Boom(Exception):
    pass


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), _Boom("killed")])
def test_write_failing_halfway_leaves_no_file(tmp_path, monkeypatch, error):
    s = _store(tmp_path)
    old = {b"old%d" % i: _kv(i) for i in range(3)}
    for key, (k, v) in old.items():
        assert s.put(key, k, v, num_tokens=5, stored_pos=0)
    before = _entries(tmp_path)
    calls = []
    real = DiskKVStore._write_chunk

    def failing(self, fd, chunk):
        calls.append(len(chunk))
        if len(calls) == 3:
            raise error
        real(self, fd, chunk)

    monkeypatch.setattr(s, "WRITE_CHUNK", 256)
    monkeypatch.setattr(DiskKVStore, "_write_chunk", failing)
    big = _kv(7, tokens=64)
    if isinstance(error, OSError):
        assert s.put(b"new", *big, num_tokens=64, stored_pos=0) is False
        assert s.stats()["write_failures"] == 1
    else:
        with pytest.raises(_Boom):
            s.put(b"new", *big, num_tokens=64, stored_pos=0)
    assert len(calls) == 3
    assert _entries(tmp_path) == before and _tmps(tmp_path) == []
    assert b"new" not in s and s.get(b"new") is None
    for key, (k, _v) in old.items():
        assert _same(s.get(key)[0], k)
    assert s.stats()["rejected"] == 0


_CHILD = r"""
import sys, time, torch
from lazyllm.cache.disk import DiskKVStore

class Slow(DiskKVStore):
    WRITE_CHUNK = 1 << 14
    def _write_chunk(self, fd, chunk):
        time.sleep(0.0005)
        super()._write_chunk(fd, chunk)

s = Slow(sys.argv[1], 1 << 30, fingerprint=sys.argv[2], settings={"chunk_context": "isolated"})
rnd = int(sys.argv[3])
for i in range(10000):
    k = torch.full((1, 256, 4, 64), float(i))
    s.put(b"child-%02d-%04d" % (rnd, i), k, -k, num_tokens=256, stored_pos=i)
"""


def test_process_killed_mid_write_leaves_the_store_readable(tmp_path):
    d = tmp_path / "kv"
    settings = {"chunk_context": "isolated"}
    s = _store(d, settings=settings)
    old = {b"old-%02d-%04d" % (0, i): _kv(i) for i in range(3)}
    for key, (k, v) in old.items():
        s.put(key, k, v, num_tokens=5, stored_pos=0)
    old_size = os.path.getsize(_file(s, next(iter(old))))
    # size of one complete child entry (keys have the same length, so the same header size)
    scratch = _store(tmp_path / "scratch", settings=settings)
    scratch.put(b"child-00-0000", torch.zeros(1, 256, 4, 64), torch.zeros(1, 256, 4, 64), num_tokens=256, stored_pos=0)
    child_size = scratch.stats()["bytes"]
    del s
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rng = random.Random(1234)
    for rnd in range(2):
        p = subprocess.Popen([sys.executable, "-c", _CHILD, str(d), FP, str(rnd)], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 30
            while True:  # until the child has finished a write and is part-way through another
                assert p.poll() is None, p.stderr.read().decode()
                assert time.monotonic() < deadline, "child never got going"
                names = os.listdir(d)
                for n in names:  # never a partial file under a final name
                    if n.endswith(".safetensors"):
                        with contextlib.suppress(FileNotFoundError):
                            assert os.path.getsize(d / n) in (old_size, child_size), n
                done = [n for n in names if n.startswith(bytes(b"child-%02d" % rnd).hex())]
                partial = []
                for n in names:
                    if n.startswith(".tmp-"):
                        with contextlib.suppress(FileNotFoundError):
                            partial.append(0 < os.path.getsize(d / n) < child_size)
                if done and any(partial):
                    break
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 0.01))
            p.send_signal(signal.SIGKILL)
        finally:
            p.kill()
            p.wait()
            p.stderr.close()
    left = _tmps(d)  # what the killed writers left behind
    assert len(left) >= 1, "the kills never landed mid-write"

    s = _store(d, settings=settings)
    assert _tmps(d) == [] and s.stats()["stale_tmp_removed"] == len(left)
    for key, (k, v) in old.items():
        out = s.get(key)
        assert out is not None and _same(out[0], k) and _same(out[1], v)
    names = [bytes.fromhex(n[:-len(".safetensors")]) for n in _entries(d)]
    children = [n for n in names if n.startswith(b"child-")]
    assert len(children) >= 2
    for key in children:
        i = int(key[-4:])
        out = s.get(key)
        assert out is not None and out[3] == i and bool((out[0] == i).all()) and bool((out[1] == -i).all())
    assert s.stats()["rejected"] == 0


def test_stale_temp_files_are_cleaned_at_startup(tmp_path):
    s = _store(tmp_path)
    s.put(b"a", *_kv(), num_tokens=5, stored_pos=0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a reaped pid: no longer alive
    (tmp_path / f".tmp-{dead.pid}-61-00000000.part").write_bytes(b"half")
    (tmp_path / ".tmp-garbage.part").write_bytes(b"half")
    ours = tmp_path / f".tmp-{os.getpid()}-62-00000000.part"  # maybe another instance of this process
    ours.write_bytes(b"being written")
    ancient = tmp_path / f".tmp-{os.getpid()}-63-00000000.part"
    ancient.write_bytes(b"left over")
    os.utime(ancient, (time.time() - 2 * 3600,) * 2)
    s2 = _store(tmp_path)
    assert _tmps(tmp_path) == [ours.name]
    assert s2.stats()["stale_tmp_removed"] == 3 and s2.stats()["files"] == 1
    assert s2.get(b"a") is not None


# -- size cap, restart ---------------------------------------------------------------------
def _entry_size(tmp_path, **kw):
    s = _store(tmp_path / "probe")
    s.put(b"e0", *_kv(**kw), num_tokens=kw.get("tokens", 5), stored_pos=0)
    return s.stats()["bytes"]


def test_size_cap_evicts_least_recently_used(tmp_path):
    size = _entry_size(tmp_path)
    s = _store(tmp_path / "kv", max_bytes=3 * size + size // 2)
    for i in range(3):
        assert s.put(b"e%d" % i, *_kv(i), num_tokens=5, stored_pos=0)
    assert s.get(b"e0") is not None  # e1 is now least recently used
    assert s.put(b"e3", *_kv(3), num_tokens=5, stored_pos=0)
    assert b"e1" not in s and not _file(s, b"e1").exists()
    assert [s.get(b"e%d" % i) is not None for i in range(4)] == [True, False, True, True]
    st = s.stats()
    assert st["evictions"] == 1 and st["files"] == 3 and st["bytes"] == 3 * size <= s.max_bytes
    assert st["bytes"] == sum(os.path.getsize(tmp_path / "kv" / n) for n in _entries(tmp_path / "kv"))


def test_overwriting_an_entry_at_the_cap_evicts_nothing(tmp_path):
    size = _entry_size(tmp_path)
    s = _store(tmp_path / "kv", max_bytes=2 * size)
    s.put(b"e0", *_kv(0), num_tokens=5, stored_pos=0)
    s.put(b"e1", *_kv(1), num_tokens=5, stored_pos=0)
    assert s.put(b"e0", *_kv(2), num_tokens=5, stored_pos=0)
    assert s.stats()["evictions"] == 0 and s.stats()["bytes"] == 2 * size
    assert _same(s.get(b"e0")[0], _kv(2)[0]) and s.get(b"e1") is not None


def test_file_written_by_another_instance_is_found_and_counted(tmp_path):
    size = _entry_size(tmp_path)
    a = _store(tmp_path / "kv", max_bytes=2 * size)
    b = _store(tmp_path / "kv", max_bytes=2 * size)
    a.put(b"e0", *_kv(0), num_tokens=5, stored_pos=0)
    a.put(b"e1", *_kv(1), num_tokens=5, stored_pos=0)
    b.put(b"e2", *_kv(2), num_tokens=5, stored_pos=0)
    assert b"e2" not in a and a.get(b"e2") is not None  # indexed on first read, cap enforced
    st = a.stats()
    assert st["files"] == 2 and st["bytes"] == 2 * size and st["evictions"] == 1 and b"e2" in a


def test_entry_larger_than_the_cap_is_not_written(tmp_path):
    size = _entry_size(tmp_path)
    s = _store(tmp_path / "kv", max_bytes=2 * size)
    s.put(b"a", *_kv(), num_tokens=5, stored_pos=0)
    big = _kv(tokens=40)
    assert s.put(b"big", *big, num_tokens=40, stored_pos=0) is False
    assert s.stats()["skipped_too_large"] == 1 and s.stats()["evictions"] == 0
    assert _entries(tmp_path / "kv") == [b"a".hex() + ".safetensors"] and _tmps(tmp_path / "kv") == []


def test_restart_finds_entries_and_keeps_recency(tmp_path):
    d = tmp_path / "kv"
    size = _entry_size(tmp_path, dtype=torch.bfloat16)
    s = _store(d)
    data = {b"e%d" % i: _kv(i, dtype=torch.bfloat16) for i in range(4)}
    for i, (key, (k, v)) in enumerate(data.items()):
        s.put(key, k, v, num_tokens=5, stored_pos=i)
        os.utime(_file(s, key), ns=(10**18 + i * 10**9,) * 2)  # distinct mtimes, put order
    assert s.get(b"e0") is not None  # most recent now (mtime refreshed)
    del s
    s = _store(d)
    st = s.stats()
    assert st["files"] == 4 and st["bytes"] == 4 * size and st["hits"] == 0
    for i, (key, (k, v)) in enumerate(data.items()):
        k2, v2, n, pos = s.get(key)
        assert _same(k2, k) and _same(v2, v) and (n, pos) == (5, i)
    # restarting with a smaller cap drops the least recently used files first
    os.utime(_file(s, b"e0"), ns=(2 * 10**18,) * 2)
    s = _store(d, max_bytes=2 * size)
    assert s.stats()["evictions"] == 2 and _entries(d) == sorted(
        [b"e0".hex() + ".safetensors", b"e3".hex() + ".safetensors"])


# -- concurrency ---------------------------------------------------------------------------
@pytest.mark.parametrize("cap_entries", [1000, 6])
def test_concurrent_put_get_and_stats(tmp_path, cap_entries):
    size = _entry_size(tmp_path, dtype=torch.float16)
    s = _store(tmp_path / "kv", max_bytes=cap_entries * size)
    keys = [b"c%02d" % i for i in range(16)]
    truth = {key: _kv(i, dtype=torch.float16) for i, key in enumerate(keys)}
    errors, stop = [], threading.Event()

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(120):
                key = rng.choice(keys)
                if rng.random() < 0.4:
                    assert s.put(key, *truth[key], num_tokens=5, stored_pos=0)
                else:
                    out = s.get(key)
                    if out is not None:  # a hit is always the exact KV of that key
                        assert _same(out[0], truth[key][0]) and _same(out[1], truth[key][1])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def watcher():
        while not stop.is_set():
            st = s.stats()
            assert st["hits"] >= 0 and st["files"] <= cap_entries
            time.sleep(0.0005)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    w = threading.Thread(target=watcher)
    w.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    w.join()
    assert errors == []
    st = s.stats()
    assert st["rejected"] == 0 and st["hits"] + st["misses"] == 6 * 120 - st["writes"] - st["write_failures"]
    names = _entries(tmp_path / "kv")
    assert st["files"] == len(names) <= cap_entries and _tmps(tmp_path / "kv") == []
    assert st["bytes"] == sum(os.path.getsize(tmp_path / "kv" / n) for n in names) <= s.max_bytes
