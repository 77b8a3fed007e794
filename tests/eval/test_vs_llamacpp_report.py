"""benchmarks/vs_llamacpp.py's own logic, without llama.cpp: arguments, depth fitting, the
statistic, the bar lines, the memory table, the memory measurement and the bytes a decode step
reads (on builtin:tiny)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "vs_llamacpp.py"


@pytest.fixture(scope="module")
def vs():
    spec = importlib.util.spec_from_file_location("vs_llamacpp_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_statistic_is_the_median_with_its_range(vs):
    assert vs.stat([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "samples": [3.0, 1.0, 2.0]}
    into = {"bf16": {"tg@0": [1.0]}}
    vs.merge(into, {"bf16": {"tg@0": [2.0], "pp512": [5.0]}, "f32": {"tg@0": [3.0]}})
    assert into == {"bf16": {"tg@0": [1.0, 2.0], "pp512": [5.0]}, "f32": {"tg@0": [3.0]}}


def test_bar_lines_say_met_or_by_how_much(vs):
    results = [
        {
            "gguf": "q8_0",
            "weights": "int8",
            "llama.cpp": {"pp512": vs.stat([100.0, 90.0, 110.0]), "tg@0": vs.stat([10.0, 10.0, 12.0])},
            "latentkv": {
                "bf16": {"pp512": vs.stat([150.0]), "tg@0": vs.stat([11.0, 13.0, 12.0])},
                "f32": {"pp512": vs.stat([120.0]), "tg@0": vs.stat([14.0])},
            },
        }
    ]
    lines = vs.bars(results, ["bf16", "f32"])
    # judged at the first tier, against issue 28's goal for int8 decode (1.2x), prefill 1.0x
    assert lines[0].startswith("int8 vs q8_0 pp512: met (1.50x at KV bf16, goal 1.0x")
    assert lines[1].startswith("int8 vs q8_0 tg@0: met (1.20x at KV bf16, goal 1.2x; bf16 1.20x, f32 1.40x")
    results[0]["latentkv"]["bf16"]["tg@0"] = vs.stat([11.0])
    assert vs.bars(results, ["bf16"])[1].startswith("int8 vs q8_0 tg@0: missed by 8% (1.10x")
    table = vs.speed_table(results, ["bf16"])
    assert "| q8_0 | int8 | tg@0 | 10.00 (10.00-12.00) | 11.00 (11.00-11.00) | 1.10x |" in table


def test_bandwidth_table_uses_the_counted_bytes(vs):
    results = [
        {
            "gguf": "q4_K_M",
            "weights": "int4",
            "llama.cpp": {},
            "latentkv": {"bf16": {"tg@0": vs.stat([20.0])}},
        }
    ]
    traffic = {"int4": {"weight_bytes": {"0": 10**9}, "kv_bytes": {"0": 0}, "read_gb_s": [25.0, 24.0, 26.0]}}
    line = vs.bandwidth_table(results, traffic, "bf16").splitlines()[-1]
    assert line == "| int4 | tg@0 | 1.000 GB | 0.0 MB | 20.00 | 20.0 | 80% of 25.0 GB/s |"


def test_bandwidth_share_uses_one_reference_for_every_format(vs):
    """Each format's child measures the read bandwidth; the shares all use the fastest median."""
    results = [
        {"gguf": g, "weights": w, "llama.cpp": {}, "latentkv": {"bf16": {"tg@0": vs.stat([10.0])}}}
        for g, w in (("q8_0", "int8"), ("q4_K_M", "int4"))
    ]
    traffic = {
        "int8": {"weight_bytes": {"0": 2 * 10**9}, "kv_bytes": {"0": 0}, "read_gb_s": [19.0, 20.0, 21.0]},
        "int4": {"weight_bytes": {"0": 10**9}, "kv_bytes": {"0": 0}, "read_gb_s": [26.0, 25.0, 24.0]},
    }
    lines = vs.bandwidth_table(results, traffic, "bf16").splitlines()[2:]
    assert lines == [
        "| int8 | tg@0 | 2.000 GB | 0.0 MB | 10.00 | 20.0 | 80% of 25.0 GB/s |",
        "| int4 | tg@0 | 1.000 GB | 0.0 MB | 10.00 | 10.0 | 40% of 25.0 GB/s |",
    ]


def test_depths_are_lowered_to_what_the_model_holds(vs, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    depths, notes = vs.fit_depths(tmp_path, [0, 512, 4096], 64)
    assert depths == [0, 512, 959] and notes == ["depth 4096 lowered to 959: the model holds 1024 positions"]


def test_memory_table_judges_the_5_percent_bar(vs):
    rows = [
        {
            "weights": w,
            "parameters": 1e6,
            "format_bytes": 1000,
            "anon_bytes_after_load": a,
            "anon_bytes_after_trim": t,
        }
        for w, a, t in (("int8", 1040, 1040), ("int4", 1300, 1010), ("bf16", 1300, 1200))
    ]
    lines = vs.memory_table(rows).splitlines()[2:]
    assert [line.rsplit("|", 2)[1].strip() for line in lines] == ["yes", "after trim", "no"]


@pytest.mark.parametrize(
    "argv",
    [
        ["m", "--pairs", "q5:int8"],
        ["m", "--depths", "x"],
        ["m", "-r", "0"],
        ["m", "--pairs", "bf16:bf16,bf16:bf16"],
    ],
)
def test_bad_options_are_one_line_exit_2(vs, argv, capsys):
    assert vs.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err


def test_memory_measure_reports_the_format_and_the_parameters(vs, tiny_dir):
    """In this process (the script runs it in a fresh child; here only the fields are checked,
    the anonymous-memory deltas depend on what ran before)."""
    from safetensors.torch import load_file

    from latentkv.models.weights import load_model

    m = vs.measure_memory(str(tiny_dir), "int4")
    params = sum(t.numel() for t in load_file(tiny_dir / "model.safetensors").values())
    assert m["weights"] == "int4" and m["parameters"] == params
    assert m["format_bytes"] == load_model(tiny_dir, "int4", device="cpu").weight_bytes() < 4 * params
    assert {"anon_bytes_after_load", "anon_bytes_after_trim", "rss_bytes_after_load"} <= m.keys()


def test_bytes_per_decode_step_are_counted(tiny_dir):
    """In a child process (the count wraps the formats' classes): every matrix a step multiplies
    by is counted (past index_topk cached tokens, DSA's indexer runs too: more matrices); the KV
    grows with the depth; int8 reads about a quarter of f32's bytes."""
    counted = {}
    for fmt in ("f32", "int8"):
        cmd = [sys.executable, str(SCRIPT), "--measure-bytes", str(tiny_dir), fmt, "0,64", "bf16", "1", "16"]
        counted[fmt] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    from latentkv.models.weights import load_model

    f32 = counted["f32"]
    assert 0 < f32["weight_bytes"]["0"] < f32["weight_bytes"]["64"]
    assert f32["kv_bytes"]["64"] > f32["kv_bytes"]["0"]
    # at most the model's matrices (the embedding's rows and the MTP layer are not read by a step)
    assert f32["weight_bytes"]["0"] <= load_model(tiny_dir, "f32", device="cpu").weight_bytes()
    assert 3 < f32["weight_bytes"]["0"] / counted["int8"]["weight_bytes"]["0"] < 4.1
    assert len(f32["read_gb_s"]) == 7 and min(f32["read_gb_s"]) > 0


def _payload(vs, depth: int, samples: dict[str, list[float]], cpu: str = "Xeon") -> dict:
    """One run's payload as main writes it: one pair, one tier."""
    return {
        "model": "/m",
        "threads": 2,
        "gen": 64,
        "kv": {"llama.cpp": "f16", "latentkv": ["bf16"]},
        "flash_attn": 1,
        "compile": False,
        "depths": [depth],
        "depths_requested": [depth],
        "prefill": 512 if depth == 0 else 0,
        "machine": {"cpu": cpu, "llama.cpp": {"version": "b1"}, "torch": "2"},
        "notes": [],
        "bars": [],
        "runs": [{"depths": [depth]}],
        "memory": [{"weights": "int8", "format_bytes": 1}],
        "bytes": {},
        "results": [
            {
                "gguf": "q8_0",
                "weights": "int8",
                "llama.cpp": {m: vs.stat(v) for m, v in samples.items()},
                "latentkv": {"bf16": {m: vs.stat([2 * x for x in v]) for m, v in samples.items()}},
            }
        ],
    }


def test_appended_runs_share_one_table(vs):
    """--append: a run's samples join the file's (same pair, metric and tier), other depths join
    the table, every statistic is recomputed, memory is kept from the first run; a run on
    another machine is refused."""
    first = _payload(vs, 0, {"pp512": [100.0], "tg@0": [10.0, 12.0]})
    second = _payload(vs, 0, {"pp512": [90.0], "tg@0": [11.0]})
    third = _payload(vs, 4096, {"tg@4096": [5.0, 6.0, 7.0]})
    merged = vs.combine(vs.combine(first, second), third)
    r = merged["results"][0]
    assert r["llama.cpp"]["tg@0"] == vs.stat([10.0, 12.0, 11.0])
    assert r["latentkv"]["bf16"]["pp512"] == vs.stat([200.0, 180.0])
    assert r["llama.cpp"]["tg@4096"]["median"] == 6.0 and len(merged["results"]) == 1
    assert merged["depths"] == [0, 4096] and merged["prefill"] == 512 and len(merged["runs"]) == 3
    assert merged["rounds"] == 2 and merged["memory"] == first["memory"]
    table = vs.speed_table(merged["results"], ["bf16"]).splitlines()
    assert [line.split("|")[3].strip() for line in table[2:]] == ["pp512", "tg@0", "tg@4096"]
    assert "cpu" in vs.combine(first, _payload(vs, 0, {"tg@0": [1.0]}, cpu="EPYC"))


def test_llama_bench_rows_give_its_own_samples(vs):
    """llama-bench's JSON: every repetition's tok/s (samples_ts, avg_ts where a build has none);
    prefill at depth 0 only (llama-bench also runs -p at every -d); its build and CPU kept."""
    base = {"build_commit": "abc", "build_number": 7, "cpu_info": "Xeon", "type_k": "f16", "flash_attn": 1}
    rows = [
        {**base, "n_prompt": 512, "n_gen": 0, "n_depth": 0, "samples_ts": [100.0, 110.0], "avg_ts": 105.0},
        {**base, "n_prompt": 512, "n_gen": 0, "n_depth": 4096, "samples_ts": [50.0], "avg_ts": 50.0},
        {**base, "n_prompt": 0, "n_gen": 64, "n_depth": 0, "samples_ts": [20.0, 21.0], "avg_ts": 20.5},
        {**base, "n_prompt": 0, "n_gen": 64, "n_depth": 4096, "avg_ts": 15.0},
    ]
    samples, about = vs.parse_llama_bench(rows)
    assert samples == {"pp512": [100.0, 110.0], "tg@0": [20.0, 21.0], "tg@4096": [15.0]}
    assert about == base


def test_latentkv_rows_are_matched_to_depths_and_prefill(vs):
    """bench decode's rows: depth 0 is context 1, prefill the context of --prefill; the other
    engine's rows and speculative rows are left out."""

    def row(ctx, tier="bf16", engine="latentkv", **extra):
        return {"engine": engine, "kv_cache_dtype": tier, "context": ctx, "prefill_tps": ctx * 1.0,
                "decode_tps": 1000.0 / ctx, **extra}  # fmt: skip

    rows = [
        row(1), row(512), row(4096), row(4096, tier="q8s"), row(1, engine="latentkv+compile"),
        row(1, speculative={"tokens_per_verify": 2.0}), row(1, engine="transformers"),
    ]  # fmt: skip
    out = vs.parse_latentkv_bench(rows, [0, 4096], 512, compiled=False)
    assert out == {
        "bf16": {"tg@0": [1000.0], "pp512": [512.0], "tg@4096": [1000.0 / 4096]},
        "q8s": {"tg@4096": [1000.0 / 4096]},
    }
    assert vs.parse_latentkv_bench(rows, [0], 0, compiled=True) == {"bf16": {"tg@0": [1000.0]}}


def test_results_json_says_where_and_how_it_was_run(vs, tmp_path, monkeypatch):
    """main's JSON (both engines stubbed): the CPU model and flags, the threads, both engines'
    versions, the statistic and the exact command of the run."""
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    (tmp_path / "tokenizer.json").write_text("{}")
    cell = vs.stat([10.0, 11.0, 12.0])
    result = {
        "gguf": "bf16",
        "weights": "bf16",
        "llama.cpp": {"tg@0": cell},
        "latentkv": {"bf16": {"tg@0": cell}},
    }
    monkeypatch.setattr(vs, "resolve", lambda model: tmp_path)
    monkeypatch.setattr(vs, "gguf", lambda *a: tmp_path / "m.gguf")
    monkeypatch.setattr(vs, "run_pairs", lambda *a, **k: ([result], [], {"build_commit": "abc"}))
    out = tmp_path / "out.json"
    argv = ["builtin:slice", "--pairs", "bf16:bf16", "--depths", "0", "--out", str(out)]
    assert vs.main(argv) == 0
    payload = json.loads(out.read_text())
    machine = payload["machine"]
    assert machine["cpu"] and isinstance(machine["cpu_flags"], list) and payload["threads"] == 2
    assert machine["llama.cpp"]["build_commit"] == "abc" and "version" in machine["llama.cpp"]
    assert "latentkv_commit" in machine and payload["statistic"].startswith("median")
    assert payload["runs"][0]["command"] == "python benchmarks/vs_llamacpp.py " + " ".join(argv)
    assert payload["bars"] == ["bf16 vs bf16 tg@0: met (1.00x at KV bf16, goal 1.0x; bf16 1.00x)"]
