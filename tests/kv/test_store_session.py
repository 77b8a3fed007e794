"""Session details the CLI leans on: recomputed rows are rewritten, a busy file is left alone."""

from __future__ import annotations

import pytest
import torch

from latentkv.config import CacheConfig
from latentkv.kv.store import KVFile, KVFileBusy, header_for
from latentkv.kv.store_session import Session
from latentkv.models.loader import Checkpoint


@pytest.fixture(scope="module")
def tiny(ours, checkpoint):
    model = ours("glm5-tiny")
    return model, Checkpoint(checkpoint("glm5-tiny")).fingerprint()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a
    )


def test_rows_recomputed_after_keep_are_rewritten_even_under_the_same_token_ids(tiny, tmp_path):
    model, fingerprint = tiny
    cfg = CacheConfig("tq4")
    current = header_for(model.cfg, model.make_cache(model.tier(cfg)), fingerprint)
    tokens = [5, 6, 7, 8, 9]
    session, cache = Session.resume(tmp_path / "k.kv", current, model.tier(cfg))
    model.forward(torch.tensor(tokens), cache)
    session.save(tokens, cache)
    session.close()

    session, cache = Session.resume(tmp_path / "k.kv", current, model.tier(cfg))
    cache.trim(3)
    session.keep(3)
    model.forward(torch.tensor([60, 61]), cache)  # other rows under the saved ids 8, 9
    session.save(tokens, cache)
    session.close()
    with KVFile.open(tmp_path / "k.kv") as f:
        result = f.load()
    assert result.tokens == tokens
    assert _same(result.to_cache(model.tier(cfg)).state(), cache.state())


def test_a_file_open_for_writing_elsewhere_is_busy_not_damaged(tiny, tmp_path):
    model, fingerprint = tiny
    cfg = CacheConfig()
    current = header_for(model.cfg, model.make_cache(model.tier(cfg)), fingerprint)
    path = tmp_path / "b.kv"
    first, _ = Session.resume(path, current, model.tier(cfg))
    with pytest.raises(KVFileBusy, match="open for writing by another process"):
        Session.resume(path, current, model.tier(cfg))
    first.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.kv"]
    again, _ = Session.resume(path, current, model.tier(cfg))
    again.close()
