"""`GraphInputs`: one step's decode-graph inputs written through the shared buffers (on the CPU the
"device" buffer is a CPU tensor; the GPU test of graph replay is tests/server/test_server_gpu.py)."""

import pytest
import torch

from server.engine.graph_inputs import GraphInputs


def test_fill_writes_each_input_and_pads_the_rest():
    x = GraphInputs(rows=4, max_pages=5, groups=("full", "sliding"), device=torch.device("cpu"))
    assert x.lens.tolist() == [1, 1, 1, 1] and x.tables["full"].shape == (4, 5)
    pages = {"full": [[7, 3], [9]], "sliding": [[2, 4], [6]]}
    lens = x.fill(3, ids=[11, 12], starts=[70, 5], pages=pages, page_size=64)  # 2 rows padded to 3
    assert lens == [71, 6, 1]
    assert x.ids[:3].tolist() == [11, 12, 0] and x.pos[:3].tolist() == [70, 5, 0]
    assert x.tables["full"][:3].tolist() == [[7, 3, 0, 0, 0], [9, 0, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert x.slots["full"][:3].tolist() == [3 * 64 + 6, 9 * 64 + 5, 0]
    assert x.slots["sliding"][:3].tolist() == [4 * 64 + 6, 6 * 64 + 5, 0]
    # a smaller step after it: its rows are rewritten whole (no page left from the last step)
    x.fill(1, ids=[13], starts=[1], pages={"full": [[8]], "sliding": [[1]]}, page_size=64)
    assert x.tables["full"][:1].tolist() == [[8, 0, 0, 0, 0]] and x.lens[:1].tolist() == [2]
    assert x.ids.dtype == x.pos.dtype == torch.int64 and x.lens.dtype == x.tables["sliding"].dtype == torch.int32


def test_fill_writes_each_rows_sampling_settings_and_pads_greedy():
    x = GraphInputs(rows=4, max_pages=2, groups=("full",), device=torch.device("cpu"))
    pages = {"full": [[1], [2]]}
    x.fill(4, ids=[1, 2], starts=[0, 0], pages=pages, page_size=64, sampling=[(0.7, 20, 0.9), (1.3, 0, 1.0)])
    assert x.temperature.tolist() == pytest.approx([0.7, 1.3, 0.0, 0.0])
    assert x.top_k.tolist() == [20, 0, 0, 0] and x.top_p.tolist() == pytest.approx([0.9, 1.0, 1.0, 1.0])
    x.fill(2, ids=[3], starts=[1], pages={"full": [[1]]}, page_size=64)  # no settings: the row is greedy too
    assert x.temperature[:2].tolist() == [0.0, 0.0] and x.top_k[:2].tolist() == [0, 0]


def test_fill_writes_a_blocks_rows_that_share_one_page_table():
    """A verify step's block: rows of one sequence hold the same page table object, each at its own
    position (a run crossing into the next page), then another sequence's rows."""
    x = GraphInputs(rows=6, max_pages=3, groups=("full",), device=torch.device("cpu"))
    first, second = [5, 8], [2, 3, 4]
    x.fill(6, ids=[1, 2, 3, 4, 5], starts=[62, 63, 64, 65, 128], pages={"full": [first] * 4 + [second]},
           page_size=64)
    assert x.tables["full"].tolist() == [[5, 8, 0]] * 4 + [[2, 3, 4], [0, 0, 0]]
    assert x.slots["full"].tolist() == [5 * 64 + 62, 5 * 64 + 63, 8 * 64, 8 * 64 + 1, 4 * 64, 0]
    assert x.lens.tolist() == [63, 64, 65, 66, 129, 1]
