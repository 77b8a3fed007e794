"""The readers the cache hands attention are data only; the torch reference reads each kind."""

from __future__ import annotations

import pytest
import torch

from latentkv.attention import readers
from latentkv.kv.cache import F32Rows, PackedRows, WindowedRows


@pytest.mark.parametrize("kind", [F32Rows, PackedRows, WindowedRows])
def test_a_reader_holds_rows_not_arithmetic(kind):
    assert not {"attend", "scores", "context", "attend_with_lse"} & set(dir(kind))
    assert kind in readers.KINDS  # the reference reads every kind the cache makes


def test_an_unknown_reader_is_refused_with_the_known_kinds():
    class Strange:
        def __len__(self):
            return 0

    with pytest.raises(ValueError, match="reads no Strange; it reads F32Rows, PackedRows, WindowedRows"):
        readers.attend(torch.zeros(1, 1, 4), Strange(), None)


def test_f32_rows_are_the_two_matmuls():
    g = torch.Generator().manual_seed(3)
    rows, query = torch.randn(9, 12, generator=g), torch.randn(2, 3, 12, generator=g)
    allowed = torch.rand(3, 9, generator=g) < 0.7
    allowed[:, 0] = True
    reader = F32Rows(rows, 8)
    s = torch.matmul(query, rows.T).masked_fill_(~allowed, float("-inf"))
    assert torch.equal(
        readers.attend(query, reader, allowed), torch.matmul(torch.softmax(s, -1), rows[:, :8])
    )
    assert torch.equal(readers.scores(query, reader), torch.matmul(query, rows.T))
