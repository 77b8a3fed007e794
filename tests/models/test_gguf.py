"""GGUF in: a GGUF written by the `gguf` package from builtin:fixture (several tensor types)
loads as the model it stores.

The reference is the safetensors checkpoint of what the gguf package dequantizes the file to
(`gguf_files.dequantized_checkpoint`), loaded in float32: the GGUF's matrices must be that
checkpoint's exactly (types held exactly) or within the reported error (re-quantized ones), and
the logits equal within the formats' compute rounding (int4 and int8 products take bfloat16
activations). Files made by llama.cpp's own converter and quantizer: test_gguf_llamacpp.py
(slow). Nothing touches the network.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_files import dequantized_checkpoint, write_gguf

from latentkv import native
from latentkv.cli import main
from latentkv.config import ModelConfig
from latentkv.models.registry import ModelNotFound, builtin_path, resolve
from latentkv.models.weights import load_model
from latentkv.tokenizer import Tokenizer
from latentkv.weights.base import format_class

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
# Every type held exactly, over every kind of matrix: fused projections of different formats
# (q_a int4 | kv_a int8 g16 | indexer.wk int8 g32), scaled ones (q_b, indexer wq_b), MLA's
# per-head k_b / v_b, experts, a quantized output head, F16 and BF16 floats.
EXACT_TYPES = {
    "token_embd.weight": "Q6_K",
    "output.weight": "Q6_K",
    "blk.4.attn_q_a.weight": "F16",
    "blk.*.attn_q_a.weight": "Q4_K",
    "blk.*.attn_kv_a_mqa.weight": "Q6_K",
    "blk.*.indexer.attn_k.weight": "Q8_0",
    "blk.*.attn_q_b.weight": "Q4_1",
    "blk.*.attn_k_b.weight": "Q8_0",
    "blk.*.attn_v_b.weight": "Q4_0",
    "blk.*.attn_output.weight": "Q5_0",
    "blk.*.ffn_gate.weight": "Q4_K",
    "blk.*.ffn_up.weight": "Q4_K",
    "blk.*.ffn_down.weight": "Q6_K",
    "blk.*.ffn_gate_exps.weight": "Q4_K",
    "blk.*.ffn_up_exps.weight": "Q4_K",
    "blk.*.ffn_down_exps.weight": "Q8_0",
    "blk.*.ffn_gate_shexp.weight": "Q4_0",
    "blk.*.ffn_up_shexp.weight": "IQ4_NL",
    "blk.*.ffn_down_shexp.weight": "Q4_1",
    "blk.*.indexer.attn_q_b.weight": "Q8_0",
    "blk.*.nextn.eh_proj.weight": "BF16",
}
IDS = torch.tensor([5, 17, 300, 42, 1000, 7, 9, 11, 400, 3000, 12, 77])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(the GGUF, its dequantized reference checkpoint, the view folder), the cache in tmp."""
    tmp = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LATENTKV_CACHE", str(tmp / "cache"))
        path = write_gguf(builtin_path("fixture"), tmp / "fixture.gguf", EXACT_TYPES, TEMPLATE)
        ref = dequantized_checkpoint(path, builtin_path("fixture"), tmp / "reference")
        yield path, ref, resolve(str(path))


@pytest.fixture(scope="module")
def loaded(files):
    path, ref, view = files
    return load_model(view, device="cpu"), load_model(ref, device="cpu")


def logits(model) -> torch.Tensor:
    return model.forward(IDS % model.cfg.vocab_size, model.make_cache(model.tier()), all_logits=True)


def test_the_config_comes_from_the_metadata(files):
    _, _, view = files
    assert ModelConfig.from_hf(view) == ModelConfig.from_hf(builtin_path("fixture"))


def test_the_tokenizer_and_chat_template_come_from_the_metadata(files):
    _, _, view = files
    ours, theirs = Tokenizer(view), Tokenizer(builtin_path("fixture"))
    text = (builtin_path("fixture") / "heldout.txt").read_text()[:4000] + " déjà vu 🙂"
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(ours.encode(text)) == text
    assert ours.chat_template == TEMPLATE


def test_every_quantized_matrix_is_held_exactly(files, loaded):
    import gguf

    path, _, view = files
    manifest = json.loads((view / "latentkv-weights.json").read_text())
    entries = manifest["tensors"]
    assert manifest["source"] == "gguf" and all(e["exact"] for e in entries.values())
    assert {e["gguf_type"] for e in entries.values()} == set(EXACT_TYPES.values()) - {"F16", "BF16"}
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    from latentkv.models.loader import Checkpoint

    ckpt = Checkpoint(view)
    checked = 0
    for name, entry in entries.items():
        if ".experts." in name and ".experts.0." not in name:
            continue
        cls = format_class(entry["format"])
        state = {p: ckpt.get(f"{name}.{entry['format']}.{p}") for p in cls.pieces}
        ours = cls.from_state(state, entry["shape"][1]).dequantize().numpy()
        t = by_name[_gguf_name(name)]
        theirs = gguf.quants.dequantize(t.data, t.tensor_type)
        theirs = (theirs[0] if ".experts." in name else theirs).reshape(ours.shape)
        if entry["format"] == "int8":
            assert np.array_equal(ours, theirs), name
        else:  # int4: scales to 2^-17, zeros rounded once (tests/weights/test_gguf_blocks.py)
            assert np.abs(ours - theirs).max() <= 2e-5 * np.abs(theirs).max(), name
        checked += 1
    assert checked > 40


def _gguf_name(name: str) -> str:
    import gguf

    parts = name.split(".")
    if ".experts." in name:
        kind = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}[parts[-2]]
        return f"blk.{parts[2]}.ffn_{kind}_exps.weight"
    if name.endswith(("k_b_proj.weight", "v_b_proj.weight")):
        return f"blk.{parts[2]}.attn_{parts[-2][0]}_b.weight"
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, 5).get_name(name, try_suffixes=(".weight",))


def test_logits_equal_the_dequantized_checkpoints(loaded):
    ours, reference = (logits(m) for m in loaded)
    kl = F.kl_div(F.log_softmax(ours, -1), F.log_softmax(reference, -1), log_target=True, reduction="none")
    # measured: max |difference| 0.008 on logits of std 1.8, KL 3e-6 (bf16 weights against f32: 2e-5);
    # where int4 reads int8 x (AVX-512 VNNI, the rounding llama.cpp's q8 activations make) KL 4.3e-5
    own = native.kernels()
    x8 = own is not None and own.isa4 == 4
    assert (ours - reference).abs().max() < 0.05
    assert kl.sum(-1).max() < (1e-4 if x8 else 2e-5)
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_a_float32_gguf_is_the_checkpoint_bit_for_bit(tmp_path, monkeypatch):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    path = write_gguf(builtin_path("fixture"), tmp_path / "f32.gguf", {})
    assert torch.equal(
        logits(load_model(resolve(str(path)), device="cpu")),
        logits(load_model(builtin_path("fixture"), device="cpu")),
    )


def test_types_without_an_exact_format_are_requantized_and_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    path = write_gguf(builtin_path("fixture"), tmp_path / "q51.gguf", {"blk.*.attn_output.weight": "Q5_1"})
    view = resolve(str(path))
    entries = json.loads((view / "latentkv-weights.json").read_text())["tensors"]
    assert {(e["gguf_type"], e["format"], e["exact"]) for e in entries.values()} == {("Q5_1", "int8", False)}
    load_model(view, progress=True, device="cpu")
    line = [x for x in capsys.readouterr().err.splitlines() if "GGUF matrices" in x][0]
    assert "5 Q5_1 -> int8 (re-quantized, relative RMS error up to" in line  # 4 layers + MTP
    error = float(line.split("up to ")[1].split("%")[0])
    assert 0 < error < 2  # 5-bit codes with a group offset, in int8 without one: about step / 8


def test_convert_writes_the_same_model(files, loaded, tmp_path, capsys):
    path, _, _ = files
    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LATENTKV_CACHE", str(files[2].parents[1]))
        assert main(["convert", str(path), str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["gguf"]["Q4_K"] == {
        "format": "int4",
        "matrices": summary["gguf"]["Q4_K"]["matrices"],
        "exact": True,
    }
    manifest = json.loads((out / "latentkv-weights.json").read_text())
    assert "model.layers.0.self_attn.k_b_proj.weight" in manifest["tensors"]
    assert not (out / "latentkv-gguf.json").exists()  # OUT stands on its own: no pointer to the GGUF
    assert torch.equal(logits(load_model(out, device="cpu")), logits(loaded[0]))


def test_generate_takes_a_gguf_and_its_split_shards(files, tmp_path, monkeypatch, capsys):
    path, _, _ = files
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    first = write_gguf(
        builtin_path("fixture"), tmp_path / "split.gguf", EXACT_TYPES, TEMPLATE, split_max_tensors=50
    )
    assert first.name == "split-00001-of-00003.gguf"
    argv = ["--prompt", "def main(", "--max-tokens", "6", "--temperature", "0", "--json"]
    outputs = []
    for model in (str(path), str(first)):
        assert main(["generate", model, *argv]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6
    with pytest.raises(ModelNotFound, match="give the first, -00001-of-00003.gguf"):
        resolve(str(tmp_path / "split-00002-of-00003.gguf"))
    (tmp_path / "split-00003-of-00003.gguf").unlink()
    with pytest.raises(ModelNotFound, match="missing beside it: split-00003-of-00003.gguf"):
        resolve(str(first))


def test_a_gguf_repo_in_the_hugging_face_cache(files, tmp_path, monkeypatch):
    path, _, view = files
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--org--fixture-GGUF" / "snapshots" / commit
    (snapshot / "Q4").mkdir(parents=True)
    shutil.copy2(path, snapshot / "Q4" / "fixture-Q4.gguf")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    found = resolve("org/fixture-GGUF")
    assert json.loads((found / "latentkv-gguf.json").read_text())["shards"] == [
        str((snapshot / "Q4" / "fixture-Q4.gguf").resolve())
    ]
    shutil.copy2(path, snapshot / "fixture-Q8.gguf")
    with pytest.raises(ModelNotFound, match="holds 2 GGUF models"):
        resolve("org/fixture-GGUF")


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate", "not a readable GGUF file"),
        ("llama", "architecture 'llama' is not an MLA model we run"),
        ("garbage", "not a readable GGUF file"),
    ],
)
def test_a_bad_gguf_is_one_line(files, tmp_path, monkeypatch, capsys, damage, message):
    path, _, _ = files
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    if damage == "truncate":
        bad.write_bytes(path.read_bytes()[:200_000])
    elif damage == "garbage":
        bad.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    else:
        write_gguf(builtin_path("tiny"), bad, {}, arch="llama")
    assert main(["generate", str(bad), "--prompt-ids", "1,2", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_plan_sizes_a_gguf_in_the_formats_it_loads_in(files, capsys):
    from latentkv.streaming.planner import make_plan

    _, ref, view = files
    cfg = ModelConfig.from_hf(view)
    gguf_plan, float_plan = make_plan(cfg, view, 8 << 30), make_plan(cfg, ref, 8 << 30)
    assert gguf_plan.sizes_from == "the GGUF"
    # int4 Q4_K matrices: 0.875 bytes per weight, int8 groups 1.125-1.25, against f32's 4
    assert gguf_plan.dense_bytes < 0.6 * float_plan.dense_bytes


# Every oracle architecture through GGUF: deepseek2 with grouped routing and YaRN (dsv3-tiny),
# without q-LoRA (the softmax scale folded into a pre-quantized q_proj), deepseek32, glm-dsa with
# shared indexer layers. k_b stays F32: its rows (qk_nope 24) are not whole blocks of 32.
ORACLE_TYPES = {
    "blk.*.attn_k_b.weight": "F32",
    "blk.*.attn_q.weight": "Q8_0",
    "blk.*.attn_q_a.weight": "Q4_0",
    "blk.*.attn_q_b.weight": "Q8_0",
    "blk.*.attn_kv_a_mqa.weight": "Q8_0",
    "blk.*.attn_v_b.weight": "Q4_1",
    "blk.*.attn_output.weight": "Q8_0",
    "blk.*.ffn_*.weight": "Q8_0",
    "blk.*.ffn_*_exps.weight": "Q4_0",
    "blk.*.indexer.attn_q_b.weight": "Q8_0",
}


@pytest.mark.parametrize(
    "name",
    [
        "dsv3-tiny",
        "dsv3-tiny-noqlora",
        pytest.param("dsv32-tiny-dsa", marks=pytest.mark.slow),  # glm-dsa's names: covered by the fixture
        pytest.param("glm5-tiny-dsa", marks=pytest.mark.slow),
    ],
)
def test_every_mla_architecture_through_gguf(name, checkpoint, tmp_path, monkeypatch):
    from latentkv.eval import oracle

    assert name in oracle.SPECS
    monkeypatch.setenv("LATENTKV_CACHE", str(tmp_path / "cache"))
    source = checkpoint(name)
    f32 = resolve(str(write_gguf(source, tmp_path / "f32.gguf", {})))
    ids = {"bos_token_id": None, "eos_token_ids": ()}  # these checkpoints have no tokenizer to give them
    expected = dataclasses.replace(ModelConfig.from_hf(source), **ids)
    assert dataclasses.replace(ModelConfig.from_hf(f32), **ids) == expected
    assert torch.equal(logits(load_model(f32, device="cpu")), logits(load_model(source, device="cpu")))
    path = write_gguf(source, tmp_path / "q.gguf", ORACLE_TYPES)
    ours = logits(load_model(resolve(str(path)), device="cpu"))
    reference = logits(load_model(dequantized_checkpoint(path, source, tmp_path / "reference"), device="cpu"))
    kl = F.kl_div(F.log_softmax(ours, -1), F.log_softmax(reference, -1), log_target=True, reduction="none")
    assert kl.sum(-1).max() < 2e-5


def test_a_small_requantization_error_keeps_two_digits():
    from latentkv.models.gguf import percent

    assert percent(0.0054) == "0.54%"
    assert percent(3.14e-5) == "0.0031%"  # not 0.00%
    assert percent(0.25) == "25%"
