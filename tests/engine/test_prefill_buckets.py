"""Token buckets of the prefill CUDA graphs: every prefill size maps to a listed bucket
that holds it, with little padding above 256 tokens."""
import torch

from lazyllm.engine.running.cuda_graphs import PrefillGraphs


def test_every_prefill_size_has_a_listed_bucket_that_holds_it():
    g = PrefillGraphs(None, None, None, max_entries=64, device=torch.device("cpu"), scratch_slot=0,
                      enabled=False, max_tokens=1024)
    buckets = g.token_buckets()
    assert buckets == sorted(set(buckets)) and buckets[-1] == 1024
    for n in range(1, 1025):
        t = g.token_bucket(n)
        assert t in buckets and t >= n
        if n > 256:
            assert t - n < PrefillGraphs.STEP  # padding under one step
    assert g.token_bucket(57) == 64 and g.token_bucket(633) == 640
    assert not g.accepts(1025, 8, 1) and not g.accepts(10, 8, 1)  # over the largest; graphs off on CPU
