"""`latentkv bench decode` over KV tiers (prefill and random fill) and `latentkv bench attention`.

Small contexts on builtin:tiny (index_topk 64, so 200 tokens exercise DSA selection). Shapes,
byte accounting and ratios only: benchmarks are never timed assertions.
"""

from __future__ import annotations

import json

import pytest
import torch

from latentkv.cli import main
from latentkv.config import CacheConfig
from latentkv.eval import bench
from latentkv.kv.cache import resolve_tier
from latentkv.kv.codecs import get_codec

TIERS = ("f32", "fp8", "tq4")
CONTEXTS = (64, 200)
DECODE = ["--decode-tokens", "3", "--kv-cache-dtype", ",".join(TIERS), "--context", "64,200"]
ROW_KEYS = {
    "engine",
    "model",
    "weight_dtype",
    "kv_cache_dtype",
    "context",
    "decode_tokens",
    "threads",
    "fill",
    "prefill_tps",
    "decode_tps",
    "decode_tps_median",
    "kv_tokens",
    "kv_bytes_per_token",
    "kv_bytes_per_token_layer",
    "kv_bytes_measured",
    "kv_bytes_predicted",
    "kv_bytes_match",
    "index_kv_bytes",
    "decode_vs_f32",
    "decode_vs_transformers",
    "speculative",  # MTP drafting stats of a latentkv+mtpN row; None otherwise
    "decode_tps_runs",  # every --repeats run's decode_tps
}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys, *argv: str) -> dict:
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def _row_bytes(tier: str, raw: dict) -> int:
    """Predicted bytes per token per layer, from the codecs alone."""
    lkv, rope = raw["kv_lora_rank"], raw["qk_rope_head_dim"]
    return get_codec(tier, lkv).bytes_per_row + get_codec(tier, rope).bytes_per_row


def _check_decode_rows(rows: list[dict], raw: dict, fill: str) -> None:
    assert [(r["context"], r["kv_cache_dtype"]) for r in rows] == [(c, t) for c in CONTEXTS for t in TIERS]
    layers = raw["num_hidden_layers"]
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["engine"] == "latentkv" and r["fill"] == fill and r["decode_tokens"] == 3
        assert r["speculative"] is None  # no --speculative asked for
        assert r["kv_tokens"] == r["context"] + 2  # the last generated token is never fed back
        assert r["kv_bytes_per_token_layer"] == _row_bytes(r["kv_cache_dtype"], raw)
        predicted = r["kv_bytes_per_token_layer"] * layers * r["kv_tokens"]
        assert r["kv_bytes_predicted"] == predicted
        assert r["kv_bytes_measured"] == predicted and r["kv_bytes_match"] is True
        index = 4 * raw["index_head_dim"] * sum(t == "full" for t in raw["indexer_types"])
        assert r["index_kv_bytes"] == index * r["kv_tokens"]
        assert r["decode_tps"] > 0 and r["decode_tps_median"] > 0
        assert r["decode_vs_transformers"] is None
        if r["kv_cache_dtype"] == "f32":
            assert r["decode_vs_f32"] == 1.0
        else:
            assert r["decode_vs_f32"] > 0


def test_decode_measures_every_tier_at_every_context_in_one_run(capsys, tmp_path, helpers, tiny_dir):
    out_file = tmp_path / "decode.json"
    payload = _json(capsys, "bench", "decode", "builtin:tiny", *DECODE, "--out", str(out_file))
    assert json.loads(out_file.read_text()) == payload
    assert payload["bench"] == "decode" and payload["fill"] == "prefill"
    assert payload["kv_cache_dtypes"] == list(TIERS) and payload["contexts"] == list(CONTEXTS)
    assert any("index_topk=64" in note for note in payload["notes"])  # 200 > 64: DSA selects
    rows = payload["rows"]
    _check_decode_rows(rows, helpers.read_config(tiny_dir), "prefill")
    assert all(r["prefill_tps"] > 0 for r in rows)


def test_random_fill_skips_the_prompt_and_reports_prefill_as_na(capsys, helpers, tiny_dir):
    payload = _json(capsys, "bench", "decode", "builtin:tiny", *DECODE, "--fill", "random")
    assert payload["fill"] == "random"
    assert any("does not depend on the rows' values" in note for note in payload["notes"])
    _check_decode_rows(payload["rows"], helpers.read_config(tiny_dir), "random")
    assert all(r["prefill_tps"] is None for r in payload["rows"])

    code, out, _ = _run(capsys, "bench", "decode", "builtin:tiny", *DECODE, "--fill", "random")
    assert code == 0
    table = [line for line in out.splitlines() if line.startswith("| latentkv")]
    assert len(table) == len(TIERS) * len(CONTEXTS)
    assert all("| random | n/a |" in line and line.endswith("| yes |") for line in table)
    assert "decode speed does not depend" in out and "index_topk=64" in out


def test_random_fill_appends_rows_to_every_layer_and_indexer(ours):
    model = ours("glm5-tiny")
    cache = model.make_cache(model.tier("fp8"))
    readers = bench.fill_random(cache, 50, chunk=16)
    layout = cache.layout
    assert cache.length == 50 and len(readers) == layout.num_layers
    assert all(len(r) == 50 for r in readers)
    assert all(cache.index_keys(i).shape == (50, layout.index_head_dim) for i in layout.index_layers)
    assert cache.allocated_nbytes() == bench.predicted_kv_bytes(cache)

    f32 = model.make_cache()
    bench.fill_random(f32, 50, chunk=16)
    c = f32.view(0)[:, : layout.kv_lora_rank]
    torch.testing.assert_close(c.square().mean(-1), torch.ones(50), rtol=1e-4, atol=1e-4)  # RMS-normed


def test_a_compiled_step_handed_to_the_row_times_decode_and_names_the_row(ours):
    """bench decode hands its compiled step to the rows that want it (the model stays eager):
    every decode pass goes through the step, the prompt through the model."""
    model = ours("glm5-tiny")
    calls: list[int] = []

    def step(tokens, cache):  # stands in for a CompiledDecode: the eager step, counted
        calls.append(tokens.shape[0])
        return model.forward(tokens, cache)

    row = bench.bench_latentkv(model, "tiny", "f32", 16, 4, compiled=step)
    assert row.engine == "latentkv+compile" and model.compiled is None
    assert calls == [1] * (1 + 3)  # one warm-up pass, then decode_tokens - 1 timed ones
    assert bench.bench_latentkv(model, "tiny", "f32", 16, 4).engine == "latentkv"
    assert len(calls) == 4  # an eager row never calls it


@pytest.mark.slow
def test_compile_adds_a_compiled_row_per_tier_that_compiles(capsys):
    argv = ["--context", "8", "--decode-tokens", "3", "--kv-cache-dtype", "f32,tq4", "--compile"]
    payload = _json(capsys, "bench", "decode", "builtin:tiny", *argv)
    assert [(r["engine"], r["kv_cache_dtype"]) for r in payload["rows"]] == [
        ("latentkv", "f32"),
        ("latentkv+compile", "f32"),
        ("latentkv", "tq4"),
    ]
    assert payload["notes"][0].startswith("f32: compiled in")
    assert payload["notes"][1].startswith("tq4: no compiled row (--compile supports the KV tiers")


def test_vs_transformers_adds_its_rows_and_the_ratio(capsys):

    argv = ["--context", "16", "--decode-tokens", "3", "--kv-cache-dtype", "f32,fp8", "--vs-transformers"]
    rows = _json(capsys, "bench", "decode", "builtin:tiny", *argv)["rows"]
    assert [(r["engine"], r["kv_cache_dtype"]) for r in rows] == [
        ("latentkv", "f32"),
        ("latentkv", "fp8"),
        ("transformers", "float32"),
    ]
    assert all(r["decode_vs_transformers"] > 0 for r in rows[:2])
    hf = rows[2]
    assert hf["kv_bytes_measured"] > 0 and hf["kv_bytes_predicted"] is None and hf["kv_bytes_match"] is None


@pytest.mark.parametrize(
    ("bench_name", "args", "message"),
    [
        ("decode", ["builtin:tiny", "--fill", "random", "--vs-transformers"], "cannot be combined"),
        ("decode", ["builtin:tiny", "--kv-cache-dtype", "f32,int3"], "unknown --kv-cache-dtype"),
        ("attention", ["--kv-lora", "48", "--kv-cache-dtype", "f32,tq4"], "kv_lora_rank 48"),
        ("attention", ["--repeats", "0"], "--repeats must be positive"),
    ],
)
def test_bench_refuses_bad_combinations_before_any_work(bench_name, args, message, capsys):
    code, out, err = _run(capsys, "bench", bench_name, *args)
    assert code == 2 and message in err and out == ""


def test_attention_bench_reports_every_tier_against_f32(capsys, tmp_path):
    tiers = ["f32", "bf16", "fp8", "tq4", "tq3", "polar4"]
    out_file = tmp_path / "attention.json"
    argv = ["--context", "1000", "--heads", "4", "--repeats", "2", "--kv-cache-dtype", ",".join(tiers)]
    payload = _json(capsys, "bench", "attention", *argv, "--out", str(out_file))
    assert json.loads(out_file.read_text()) == payload
    assert payload["bench"] == "attention" and payload["kv_cache_dtypes"] == tiers
    assert (payload["kv_lora_rank"], payload["rope_dim"], payload["heads"]) == (512, 64, 4)
    rows = payload["rows"]
    assert [r["kv_cache_dtype"] for r in rows] == tiers
    stored = {r["kv_cache_dtype"]: r["bytes_per_token"] for r in rows}
    assert {k: stored[k] for k in ("f32", "bf16", "fp8", "tq4", "tq3")} == {
        "f32": 2304,
        "bf16": 1152,
        "fp8": 584,
        "tq4": 296,
        "tq3": 224,
    }
    for r in rows:
        assert r["context"] == 1000 and r["repeats"] == 2
        assert r["cache_bytes"] == r["bytes_per_token"] * 1000 and r["cache_bytes_match"]
        assert min(r["scores_ms"], r["context_ms"], r["total_ms"], r["speed_vs_f32"]) > 0
    assert rows[0]["speed_vs_f32"] == 1.0 and rows[0]["rel_err_vs_f32"] == 0.0
    errors = {r["kv_cache_dtype"]: r["rel_err_vs_f32"] for r in rows}
    assert errors["bf16"] < 0.01 and errors["fp8"] < 0.05 and errors["tq4"] < 0.2  # the right rows


def test_attention_rows_and_queries_depend_only_on_the_seed():
    a, out_a = bench.bench_attention("fp8", 300, heads=2, kv_lora_rank=32, rope_dim=8, repeats=1)
    b, out_b = bench.bench_attention("fp8", 300, heads=2, kv_lora_rank=32, rope_dim=8, repeats=1)
    assert torch.equal(out_a, out_b) and a.cache_bytes == b.cache_bytes == 300 * (32 + 4 + 8 + 4)


def test_attention_table_prints_one_markdown_row_per_tier(capsys):
    argv = ["--context", "600", "--heads", "2", "--kv-lora", "64", "--rope", "16", "--repeats", "1"]
    code, out, _ = _run(capsys, "bench", "attention", *argv, "--kv-cache-dtype", "f32,tq4")
    assert code == 0
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| KV | context |") and len(lines) == 3
    assert lines[1].startswith("| f32 | 600 |") and "| 1.00x |" in lines[1]
    assert lines[2].startswith("| tq4 | 600 |")


def test_measured_bytes_of_an_f32_cache_come_from_its_row_tensors():
    layout = bench.attention_layout(16, 8, torch.device("cpu"))
    cache = resolve_tier(layout, CacheConfig("f32")).make_cache()
    bench.fill_random(cache, 10)
    assert cache.allocated_nbytes() == 10 * 24 * 4 == bench.predicted_kv_bytes(cache)


@pytest.mark.parametrize("statistic", ["fastest", "median"])
def test_repeats_keep_every_run_and_report_the_chosen_statistic(capsys, statistic):
    argv = ["--decode-tokens", "3", "--context", "8", "--repeats", "3", "--statistic", statistic]
    payload = _json(capsys, "bench", "decode", "builtin:tiny", *argv)
    assert payload["repeats"] == 3 and payload["statistic"] == statistic
    (row,) = payload["rows"]
    runs = sorted(row["decode_tps_runs"])
    assert len(runs) == 3
    assert row["decode_tps"] == (runs[-1] if statistic == "fastest" else runs[1])


def test_pick_takes_the_median_row_of_an_even_count_from_below():
    from types import SimpleNamespace

    from latentkv.commands.bench.common import pick

    speeds = iter([5.0, 2.0, 9.0, 4.0])
    row = pick(4, lambda: SimpleNamespace(decode_tps=next(speeds)), "median")
    assert row.decode_tps == 4.0 and row.decode_tps_runs == [5.0, 2.0, 9.0, 4.0]
    with pytest.raises(ValueError, match="unknown statistic 'mean'"):
        pick(1, lambda: SimpleNamespace(decode_tps=1.0), "mean")
