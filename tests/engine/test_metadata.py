"""A prefill step's attention metadata (``ModelRunner.metadata``): the tables' four planes
carry exactly the packed entries, and each plane starts on 16 bytes whatever the number of
sequences and the table width. Triton specializes a kernel on each pointer argument's 16-byte
alignment, so planes packed end to end would give a round of 3 tables of 7 entries other
kernel variants than the warm-up compiled, and a request would wait for a compile."""
from __future__ import annotations

import random

import pytest
import torch

from lazyllm import LazyLLM
from lazyllm.engine.request import TableEntry, pack_tables
from tests.conftest import make_tiny


@pytest.fixture(scope="module")
def runner(tokenizer):
    llm = LazyLLM(model=make_tiny("llama", seed=2), tokenizer=tokenizer, kv_cache_bytes=8 << 20, page_size=16,
                  quality="isolated", device="cpu")
    yield llm.engine.runner
    llm.close()


@pytest.mark.parametrize("n_tables,width", [(1, 1), (1, 7), (3, 7), (2, 5), (5, 16), (6, 17), (160, 17)])
def test_table_planes_are_the_packed_entries_each_on_16_bytes(runner, n_tables, width):
    rng = random.Random(n_tables * 100 + width)
    tables = [[TableEntry(rng.randrange(64), 16 * i, rng.randrange(-40, 40), rng.randrange(1, 17))
               for i in range(rng.randint(1, width))] for _ in range(n_tables)]
    tables[0] = tables[0] + [TableEntry(1, 16 * len(tables[0]), 0, 3)] * (width - len(tables[0]))  # one at full width
    n = 5
    cu = [0] + [n] * n_tables
    _, _, meta = runner.metadata(list(range(n)), list(range(n)), list(range(n)), cu, tables, n, [n - 1])
    packed = pack_tables(tables, width)
    planes = (meta.block_table, meta.block_pos, meta.block_delta, meta.block_len)
    for plane, want in zip(planes, packed):
        assert plane.shape == (n_tables, width)
        assert plane.tolist() == want.tolist()
        assert plane.data_ptr() % 16 == 0, (n_tables, width)
        assert plane.stride() == (width, 1)


@pytest.mark.parametrize("n_decode,n_tables,width", [(1, 1, 3), (2, 3, 7), (3, 1, 16)])
def test_decode_rows_tables_come_first_each_plane_on_16_bytes(runner, n_decode, n_tables, width):
    """Mixed steps: the first ``n_decode`` sequences' tables are the decode state's rows on
    the device, the others' come from the host; the joined planes start on 16 bytes too."""
    state = runner.decode_state.tables
    rows = torch.randint(0, 50, (4, n_decode, width), dtype=state.dtype, generator=torch.Generator().manual_seed(width))
    state[:, :n_decode, :width] = rows
    tables = [[TableEntry(3 + b, 16 * i, 0, 16) for i in range(width)] for b in range(n_tables)]
    cu = list(range(n_decode + n_tables + 1))
    n = len(cu) - 1
    _, _, meta = runner.metadata([0] * n, [0] * n, [0] * n, cu, tables, 1, [], head=(n_decode, width))
    packed = pack_tables(tables, width)
    for k, plane in enumerate((meta.block_table, meta.block_pos, meta.block_delta, meta.block_len)):
        assert plane.shape == (n_decode + n_tables, width)
        assert plane[:n_decode].tolist() == rows[k].tolist()
        assert plane[n_decode:].tolist() == packed[k].tolist()
        assert plane.data_ptr() % 16 == 0, (n_decode, n_tables, width)
