"""benchmarks/vs_llamacpp.py's own logic, without llama.cpp: arguments, depth fitting, the
bar lines, the memory table and the memory measurement (on builtin:tiny, in a child process)."""

from __future__ import annotations

import importlib.util
import json
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


def test_bar_lines_say_met_or_by_how_much(vs):
    results = [
        {
            "gguf": "q8_0",
            "weights": "int8",
            "llama.cpp": {"pp512": 100.0, "tg@0": 10.0},
            "latentkv": {"f32": {"pp512": 150.0, "tg@0": 6.0}, "bf16": {"pp512": 120.0, "tg@0": 8.0}},
        }
    ]
    lines = vs.bars(results, ["f32", "bf16"])
    assert lines[0].startswith("int8 vs q8_0 pp512: met (1.50x at KV f32")
    assert lines[1].startswith("int8 vs q8_0 tg@0: missed by 20% (0.80x at KV bf16")
    table = vs.speed_table(results, ["f32", "bf16"])
    assert "| q8_0 | int8 | tg@0 | 10.00 | 6.00 | 0.60x | 8.00 | 0.80x |" in table


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


@pytest.mark.parametrize("argv", [["m", "--pairs", "q5:int8"], ["m", "--depths", "x"], ["m", "-r", "0"]])
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
    assert m["format_bytes"] == load_model(tiny_dir, "int4").weight_bytes() < 4 * params
    assert {"anon_bytes_after_load", "anon_bytes_after_trim", "rss_bytes_after_load"} <= m.keys()
