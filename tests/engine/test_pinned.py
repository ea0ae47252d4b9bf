"""``PinnedTurns``: two host buffers used in turn for asynchronous copies."""
import numpy as np
import pytest
import torch

from lazyllm.engine.pinned import PinnedTurns


def test_buffers_alternate_and_keep_their_contents():
    t = PinnedTurns("cpu", torch.int32, n=4)
    assert [t.take() for _ in range(4)] == [0, 1, 0, 1]
    k = t.take()
    t.arrays[k][:] = [1, 2, 3, 4]  # the numpy view writes the buffer itself
    t.record(k)
    other = t.take()
    assert other != k
    t.bufs[other].fill_(9)
    assert t.bufs[k].tolist() == [1, 2, 3, 4]  # the other turn does not touch it
    assert t.take() == k and t.bufs[k].tolist() == [1, 2, 3, 4]


def test_sizes_and_dtypes():
    t = PinnedTurns(torch.device("cpu"), torch.float64, n=6)
    assert [b.numel() for b in t.bufs] == [6, 6]
    assert all(b.dtype == torch.float64 for b in t.bufs) and all(a.dtype == np.float64 for a in t.arrays)
    assert PinnedTurns("cpu").bufs[0].dtype == torch.long and PinnedTurns("cpu").bufs[0].numel() == 0


def test_a_buffer_grows_when_asked_for_more_room():
    t = PinnedTurns("cpu", torch.int32)
    k = t.take(5)
    assert t.bufs[k].numel() == 5 and t.bufs[1 - k].numel() == 0  # only the buffer handed out grows
    t.take(3)
    k = t.take(7)
    assert t.bufs[k].numel() == 10  # at least double: few reallocations as batches grow
    t.arrays[k][:] = 3
    assert int(t.bufs[k].sum()) == 30  # the numpy view follows the new buffer
    assert t.take(2) != k and t.bufs[k].numel() == 10  # no shrinking


def test_send_copies_to_the_device_and_keeps_the_host_buffer():
    t = PinnedTurns("cpu", torch.float32, n=3)
    k = t.take(3)
    t.bufs[k][:] = torch.tensor([0.5, 1.5, 2.5])
    dev = t.send(k, t.bufs[k][:2])
    assert dev.tolist() == [0.5, 1.5] and t.bufs[k].tolist() == [0.5, 1.5, 2.5]


def test_cpu_fallback_without_cuda(monkeypatch):
    """A CUDA device where CUDA is absent: ordinary buffers, no events, nothing waits."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = PinnedTurns("cuda", torch.int64, n=2)
    assert not t.cuda and t.events == [None, None]
    assert not t.bufs[0].is_pinned()
    k = t.take(4)
    t.record(k)  # no event to record: a no-op
    assert t.bufs[k].numel() == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_with_events_on_cuda():
    t = PinnedTurns("cuda", torch.int64, n=8)
    assert t.cuda and all(b.is_pinned() for b in t.bufs) and all(e is not None for e in t.events)
    k = t.take(8)
    t.bufs[k][:] = torch.arange(8)
    dev = t.send(k, t.bufs[k])
    t.take()
    assert t.take() == k  # waits for the copy above before handing the buffer out again
    assert dev.cpu().tolist() == list(range(8))
