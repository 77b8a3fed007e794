"""tools/train_moe.py: its fast training forward computes what transformers' GlmMoeDsa modules
compute (the model it trains is the one latentkv and transformers load), a resumed run continues
exactly where it stopped, and its data transforms do what they say."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import types
from pathlib import Path

import pytest
import torch

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train_moe.py"


@pytest.fixture(scope="module")
def tm():
    spec = importlib.util.spec_from_file_location("train_moe", TRAIN_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module


def _tiny(tm, **over):
    a = dict(
        layers=3,
        context=256,
        index_topk=1024,
        hidden=64,
        heads=4,
        dense_inter=96,
        expert_inter=16,
        experts=8,
        top_k=3,
    )
    a.update(over)
    return tm.model_config(300, types.SimpleNamespace(**a))


def _build(tm, cfg):
    config, model, mtp = tm.tf.build(cfg, 0)
    model.config._experts_implementation = "eager"
    for g in model.modules():  # a non-zero routing bias, as after balancing
        if hasattr(g, "e_score_correction_bias"):
            g.e_score_correction_bias.normal_(0, 0.05)
    return config, model, mtp


def test_fast_forward_matches_transformers(tm):
    """Logits of the patched stack (SDPA's causal kernel, experts grouped into one batched GEMM,
    the router outside autocast) against transformers' own modules, float32, on fresh random
    weights and tokens; the indexer selects every token (context < index_topk)."""
    _, model, _ = _build(tm, _tiny(tm))
    ids = torch.randint(0, 300, (2, 100), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        orig = tm.patch_for_training()
        try:
            mm = model.model
            h = mm.embed_tokens(ids)
            got = model.lm_head(
                mm.norm(tm.run_stack(mm.layers, h, mm.rotary_emb(h, torch.arange(100)[None])))
            )
        finally:
            tm.unpatch(orig)
    # float32 sums in another order; the logits are ~1 in size
    assert (ref - got).abs().max() < 1e-4


def test_grouped_experts_match_the_loop(tm):
    """The padded batched-GEMM experts against transformers' per-expert loop, float64, with an
    unbalanced routing (one expert takes most tokens, one none)."""
    _, model, _ = _build(tm, _tiny(tm))
    experts = model.model.layers[1].mlp.experts.double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 64, dtype=torch.float64, generator=g)
    idx = torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(40)])  # expert 7 unused
    idx[:30, 0] = 0
    idx[:30, 1:] = torch.where(idx[:30, 1:] == 0, 5, idx[:30, 1:])
    w = torch.rand(40, 3, dtype=torch.float64, generator=g)
    ref = experts(x, idx, w)  # transformers' eager loop (_build chose it)
    assert torch.allclose(tm.experts_forward(experts, x, idx, w), ref, atol=1e-12)


def test_rename_keeps_structure_and_hides_names(tm):
    text = "def frobnicate(widget):\n    return widget + widget_count\n\nfrobnicate(3)\nwidget = 1\n"
    out = tm.rename_identifiers(text, random.Random(0), 2)
    assert out != text
    # whole words only: renaming `widget` leaves `widget_count` alone; keywords never change
    assert "widget_count" in out and out.count("def ") == 1 and "return" in out
    names = set(re.findall(r"\b[a-z]+_[a-z]+\b", out)) - {"widget_count"}
    for n in names:
        assert out.count(n) >= 2  # a renamed identifier is renamed at every occurrence


def test_resume_continues_exactly(tm, tmp_path, monkeypatch):
    """Three steps straight and one + two with a restart between end with the same weights."""
    monkeypatch.setattr(tm, "heldout_eval", lambda *a, **k: {"loss": 1.0, "mtp_loss": 1.0, "recall": {}})
    text = "\n".join(f"def fn_{i}(value):\n    return value * {i}\n" for i in range(400))

    class Tok:  # bytes as tokens
        def encode(self, s):
            return types.SimpleNamespace(ids=list(s.encode()))

        def token_to_id(self, s):
            return 0

        def get_vocab_size(self):
            return 300

    def run(work: Path, stop_after: int):
        args = tm.parse(
            [
                "train",
                "--work",
                str(work),
                "--steps",
                "3",
                "--tokens-per-step",
                "128",
                "--micro-tokens",
                "64",
                "--context",
                "64",
                "--short-context",
                "32",
                "--short-frac",
                "0.5",
                "--warmup",
                "1",
                "--layers",
                "2",
                "--hidden",
                "32",
                "--experts",
                "4",
                "--top-k",
                "2",
                "--expert-inter",
                "16",
                "--dense-inter",
                "32",
                "--eval-every",
                "100",
                "--stop-after",
                str(stop_after),
                "--quiet-file",
                str(work / "QUIET"),
            ]
        )
        work.mkdir(exist_ok=True)
        last = work / "last.pt"
        state = torch.load(last, weights_only=False) if last.exists() else tm.new_state(args, Tok())
        orig = tm.patch_for_training()
        try:
            tm.pretrain(state, work, tm.Windows(text, Tok(), args), (None, None), args, lambda m: None)
        finally:
            tm.unpatch(orig)
        return torch.load(last, weights_only=False)

    straight = run(tmp_path / "a", 3)
    assert run(tmp_path / "b", 1)["step"] == 1
    resumed = run(tmp_path / "b", 5)
    assert resumed["step"] == straight["step"] == 3 and resumed["phase"] == "indexer"
    for k, v in straight["model"].items():
        assert torch.equal(v, resumed["model"][k]), k


def test_planted_use_is_tokenized_as_the_definition(tm):
    """Version 3 plants the use unindented, as `eval recall` does, so the fixture's byte-level BPE
    gives the name the same tokens at both places; the old indented use did not (`Ġk` for `k`)."""
    from latentkv.models.registry import builtin_path
    from latentkv.tokenizer import Tokenizer

    tok = Tokenizer(builtin_path("fixture"))
    lines = ["import os\n"] + ["def f(x):\n", "    y = x + 1\n", "    return y\n"] * 4
    name = "kovu_relami"
    for indented, same in ((False, True), (True, False)):
        out = "".join(tm.plant_line(lines, name, random.Random(0), 1, 9, indented))
        assert out.count(name) == 2
        ids, offsets = tok.encode_with_offsets(out)
        at = [
            next(i for i, (_, end) in enumerate(offsets) if end > c)
            for c in (out.index(name), out.rindex(name))
        ]
        assert (ids[at[0]] == ids[at[1]]) is same, [tok.decode([ids[i]]) for i in at]


def test_recipe_changes_are_recorded(tm, tmp_path):
    """A resume takes the checkpoint's recipe over the flags, adds this version's new settings and
    the explicit --change ones, and records both with the step and the trainer version."""
    args = tm.parse(["train", "--work", str(tmp_path), "--repeat-prob", "0.9", "--change", "repeat_prob=1.0"])
    state = {"step": 40, "args": {"repeat_prob": 0.3, "lr": 1e-3}}
    tm.apply_changes(state, args, lambda m: None)
    assert args.repeat_prob == 1.0 and args.lr == 1e-3  # --change wins; the checkpoint beats the flag
    entry = state["recipe_changes"][-1]
    assert entry["step"] == 40 and entry["trainer_version"] == tm.TRAINER_VERSION
    assert entry["changed"] == {"repeat_prob": 1.0} and entry["added"]["long_repeats"] == 3
    assert state["args"]["repeat_prob"] == 1.0 and "work" not in entry["added"]
    with pytest.raises(SystemExit, match="no run to change"):  # nothing to resume: no silent new run
        tm.main(["train", "--work", str(tmp_path / "empty"), "--change", "steps=10", "--stop-after", "0"])
    assert not (tmp_path / "empty").exists()
    bad = tm.parse(["train", "--work", str(tmp_path), "--change", "nonsense=1"])
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        tm.apply_changes({"step": 0, "args": {}}, bad, lambda m: None)


def test_copy_segments_repeat_earlier_text_token_for_token(tm):
    """Distinct tokens in: every token out is either the next unread input token or part of a
    repeat of an earlier stretch of the window; about a third are repeats, from near and far."""
    ids = list(range(100_000))
    out = tm.copy_segments(ids, random.Random(0), 4096)
    assert len(out) == 4096
    fresh, seen, repeats, distances = 0, set(), 0, []
    for pos, t in enumerate(out):
        if t == fresh:
            fresh += 1
        else:
            assert t in seen and t < fresh  # a repeat of what came before
            repeats += 1
            distances.append(pos - out.index(t))
        seen.add(t)
    assert 0.2 < repeats / len(out) < 0.5
    assert min(distances) < 512 and max(distances) > 2048


def _synthetic_args(tm, **over):
    a = dict(
        synthetic_copy_frac=0.5,
        synthetic_min_len=16,
        synthetic_max_len=128,
        synthetic_min_distance=64,
        synthetic_max_distance=4096,
        synthetic_layout="scattered",
    )
    a.update(over)
    return types.SimpleNamespace(**a)


def test_synthetic_windows_copy_exactly_from_near_and_far(tm):
    """Every masked token equals the token `distance` back, and so does the one before it (the copy
    is readable from an earlier occurrence); about the asked share is copied, from 64 to ~4000
    tokens back; the avoided token (EOT) never appears."""
    ids, mask = tm.synthetic_window(random.Random(3), 4096, 500, 7, _synthetic_args(tm))
    assert len(ids) == len(mask) == 4096 and 7 not in ids and max(ids) == 499
    assert 0.4 < sum(mask) / 4096 < 0.55
    distances = []
    for pos in range(1, 4096):
        if mask[pos]:
            # the distance of this copy: the nearest earlier position whose token and predecessor match
            d = next(
                d for d in range(1, pos) if ids[pos - d] == ids[pos] and ids[pos - d - 1] == ids[pos - 1]
            )
            distances.append(d)
    assert min(distances) >= 1 and max(distances) > 2048
    assert sum(d < 512 for d in distances) > 0.2 * len(distances)
    # unmasked random tokens are not copies: with 500 tokens a chance match is rare
    free = [p for p in range(1, 4096) if not mask[p] and not mask[p - 1]]
    assert len(free) > 1000


def test_synthetic_copies_are_exact_at_their_own_distance(tm):
    """With distinct random draws (a huge vocabulary) nothing repeats by chance: each run of masked
    tokens, with the unmasked copy start before it, repeats an earlier stretch exactly at one
    distance (a copy may read from an earlier copy, so the stretch can occur twice)."""
    rng = random.Random(5)
    ids, mask = tm.synthetic_window(rng, 1024, 10**9, -1, _synthetic_args(tm, synthetic_max_distance=1024))
    runs, pos = 0, 1
    while pos < 1024:
        if mask[pos]:
            start = pos - 1  # the copy's first token: unmasked, already a repeat
            assert not mask[start]
            end = pos
            while end < 1024 and mask[end]:
                end += 1
            run = ids[start:end]
            assert any(ids[start - d : end - d] == run for d in range(end - start, start + 1)), start
            runs, pos = runs + 1, end
        pos += 1
    assert runs >= 4


def test_mixed_batch_and_the_anneal(tm):
    """Share 0 draws exactly the text batch; share 0.5 of 4 windows puts 2 synthetic windows last
    with their masks, seeded by the step; the share holds until the synthetic loss's running mean
    falls below the threshold, then goes linearly to the final share."""
    text = "\n".join(f"def fn_{i}(value):\n    return value * {i}\n" for i in range(400))

    class Tok:
        def encode(self, s):
            return types.SimpleNamespace(ids=list(s.encode()))

        def token_to_id(self, s):
            return 0

        def get_vocab_size(self):
            return 300

    args = tm.parse(
        [
            "train",
            "--work",
            "w",
            "--synthetic-share",
            "0.5",
            "--synthetic-max-len",
            "16",
            "--synthetic-min-distance",
            "16",
        ]
    )
    args.short_context = 64
    w = tm.Windows(text, Tok(), args)
    x0, m0 = w.mixed_batch(3, 4, 64, 0.0)
    assert m0 is None and torch.equal(x0, w.batch(3, 4, 64))
    x, m = w.mixed_batch(3, 4, 64, 0.5)
    assert x.shape == (4, 64) and m.shape == (2, 64) and m.any()
    assert torch.equal(x[:2], x0[:2]) and torch.equal(x, w.mixed_batch(3, 4, 64, 0.5)[0])
    assert not torch.equal(x, w.mixed_batch(4, 4, 64, 0.5)[0])
    assert x[2:].max() > 40  # the whole vocabulary of 300 by default
    args.synthetic_alphabet = 20  # --synthetic-alphabet 20: ids 1-20 (0 is the EOT, skipped)
    xa, _ = w.mixed_batch(3, 4, 64, 0.5)
    assert xa[2:].min() >= 1 and xa[2:].max() <= 20 and len(set(xa[2:].flatten().tolist())) > 10
    args.synthetic_alphabet = 0

    args.synthetic_final_share, args.synthetic_anneal_below, args.synthetic_anneal_steps = 0.1, 2.0, 10
    state = {"step": 0}
    for step, loss in enumerate([8.0, 8.0, 1.0, 1.0]):
        state["step"] = step + 1
        tm.track_synthetic(state, loss, args)
    assert state.get("synthetic_anneal_from") is None and tm.synthetic_share(10, state, args) == 0.5
    for step in range(4, 40):
        state["step"] = step + 1
        tm.track_synthetic(state, 0.5, args)
    start = state["synthetic_anneal_from"]
    assert tm.synthetic_share(start, state, args) == 0.5
    assert tm.synthetic_share(start + 5, state, args) == pytest.approx(0.3)
    assert tm.synthetic_share(start + 50, state, args) == pytest.approx(0.1)


def test_init_from_loads_an_export(tm, tmp_path):
    """export's folder loads back (the MTP layer's DeepSeek-V3 names mapped to the trainer's) into
    the weights it was written from, to bf16 rounding; a folder of another model is refused."""
    cfg = _tiny(tm)
    _, model, mtp = _build(tm, cfg)

    class Tok:
        def save(self, path):
            Path(path).write_text("{}")

    tm.tf.save(tmp_path / "m", model, mtp, cfg, Tok(), ["x"], [1], {})
    _, model_state, mtp_state = tm.load_exported(tmp_path / "m")
    for ref, got in ((model.state_dict(), model_state), (mtp.state_dict(), mtp_state)):
        for k, v in ref.items():
            if k.endswith("inv_freq"):
                continue
            assert torch.equal(got[k], v.to(torch.bfloat16).float()) or k.endswith("correction_bias"), k
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "m" / "model.safetensors"))
    del weights["model.layers.1.mlp.gate.weight"]
    save_file(weights, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(SystemExit, match="not a model this trainer exported"):
        tm.load_exported(tmp_path / "m")


def test_grow_starts_as_the_shallower_model(tm):
    """--grow-from: a 4-layer model grown from a trained-looking 2-layer checkpoint computes the
    2-layer model's logits exactly (float32), because the new layers write zeros into the residual
    stream; and the new layers are there to learn (their inputs random, not zero). A grow that
    skipped the zeroing would change the logits: checked as the control."""
    src_cfg = _tiny(tm, layers=2)
    _, src, src_mtp = _build(tm, src_cfg)
    source = {"config": src_cfg, "model": src.state_dict(), "mtp": src_mtp.state_dict()}
    cfg = _tiny(tm, layers=4)
    _, grown, mtp = _build(tm, cfg)
    assert tm.grow(grown, mtp, cfg, source) == 2
    ids = torch.randint(0, 300, (2, 60), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(grown(input_ids=ids).logits, src(input_ids=ids).logits)
        for k, v in mtp.state_dict().items():
            assert torch.equal(v, source["mtp"][k])
        attn = grown.model.layers[3].self_attn
        assert attn.q_a_proj.weight.abs().sum() > 0 and attn.o_proj.weight.abs().sum() == 0
        # control: the same grow with the new layers' down projections left random
        _, other, other_mtp = _build(tm, cfg)
        keep = tm.RESIDUAL_WRITERS
        tm.RESIDUAL_WRITERS = ("self_attn.o_proj.weight",)
        try:
            tm.grow(other, other_mtp, cfg, source)
        finally:
            tm.RESIDUAL_WRITERS = keep
        assert not torch.equal(other(input_ids=ids).logits, src(input_ids=ids).logits)


def test_grow_refuses_another_shape(tm):
    src_cfg = _tiny(tm, layers=2)
    _, src, src_mtp = _build(tm, src_cfg)
    source = {"config": src_cfg, "model": src.state_dict(), "mtp": src_mtp.state_dict()}
    wider = _tiny(tm, layers=4, hidden=128)
    _, model, mtp = _build(tm, wider)
    with pytest.raises(SystemExit, match="hidden_size"):
        tm.grow(model, mtp, wider, source)
    shallower = _tiny(tm, layers=1)
    _, model, mtp = _build(tm, shallower)
    with pytest.raises(SystemExit, match="2 layers, more than 1"):
        tm.grow(model, mtp, shallower, source)


def test_grow_into_a_longer_context(tm):
    """Plain RoPE has no weights that depend on the context length: a model trained on 256-token
    windows grows into one of 4096 (the copy toy is trained short)."""
    src_cfg = _tiny(tm, layers=2, context=256)
    _, src, src_mtp = _build(tm, src_cfg)
    source = {"config": src_cfg, "model": src.state_dict(), "mtp": src_mtp.state_dict()}
    cfg = _tiny(tm, layers=3, context=4096)
    _, grown, mtp = _build(tm, cfg)
    assert tm.grow(grown, mtp, cfg, source) == 2


def test_periodic_window_has_the_period_asked(tm):
    """--synthetic-min-distance 64 --synthetic-max-distance 64 means period 64: exp(log(64)) is
    63.99999..., which int() made 63 (a toy trained on it learned a fixed 63-token offset, not
    copying)."""
    args = _synthetic_args(
        tm, synthetic_layout="periodic", synthetic_min_distance=64, synthetic_max_distance=64
    )
    for seed in range(20):
        ids, mask = tm.synthetic_window(random.Random(seed), 256, 4096, 0, args)
        assert ids[64:] == ids[:-64] and ids[63:] != ids[:-63] and mask.index(True) == 65


def test_induction_targets(tm):
    """Previous-token keys are i-1; induction keys are j+1 for every earlier j holding the query's
    token, checked against a loop on random windows of a small alphabet (many repeats)."""
    x = torch.randint(0, 5, (3, 40), generator=torch.Generator().manual_seed(2))
    prev, ind = tm.induction_targets(x)
    for b in range(3):
        for i in range(40):
            want_prev = {i - 1} if i else set()
            want_ind = {j + 1 for j in range(i) if x[b, j] == x[b, i]}
            assert set(prev[b, i].nonzero().flatten().tolist()) == want_prev
            assert set(ind[b, i].nonzero().flatten().tolist()) == want_ind


def test_attention_supervision_measures_the_head(tm):
    """The supervised head's loss is -log of its attention mass on the targets, computed from the
    patched forward's own q and k: compared with attention weights recomputed from transformers'
    eager attention for that head (float32), and it falls when that head is trained on it alone."""
    cfg = _tiny(tm, layers=2)
    _, model, _ = _build(tm, cfg)
    x = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(3))
    x[:, 24:] = x[:, :24]  # a repeat: every query of the second half has an induction target
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        ref = model(input_ids=x, output_attentions=True).attentions  # [B, H, S, S] per layer
    prev, ind = tm.induction_targets(x)
    want = [-(a[:, 0] * t).sum(-1)[t.any(-1)].log().mean() for a, t in zip(ref, (prev, ind), strict=True)]
    orig = tm.patch_for_training()
    try:
        armed = tm.supervised_attention(model, (0, 1), x)
        mm = model.model
        h = mm.embed_tokens(x)
        with torch.no_grad():
            tm.run_stack(mm.layers, h, mm.rotary_emb(h, torch.arange(48)[None]))
        got = [m.supervise["loss"] for m in armed]
        for g, w in zip(got, want, strict=True):
            assert abs(g.item() - w.item()) < 1e-4
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        first = None
        for _ in range(30):
            opt.zero_grad()
            h = mm.embed_tokens(x)
            tm.run_stack(mm.layers[:1], h, mm.rotary_emb(h, torch.arange(48)[None]))
            loss = armed[0].supervise["loss"]
            first = loss.item() if first is None else first
            loss.backward()
            opt.step()
        assert loss.item() < 0.5 * first
    finally:
        tm.supervised_attention(model, (0, 1), None)
        tm.unpatch(orig)


def test_identity_supervision_reads_the_previous_token(tm):
    """--induction-identity: the previous-token head's write into the residual stream, read with
    the input embedding, is trained to name the previous token; the embedding itself gets no
    gradient from it, and the loss falls when the layer is trained on it."""
    cfg = _tiny(tm, layers=2)
    _, model, _ = _build(tm, cfg)
    x = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(4))
    orig = tm.patch_for_training()
    try:
        mm = model.model
        opt = torch.optim.Adam(mm.layers[0].parameters(), lr=3e-3)
        first = None
        for _ in range(40):
            opt.zero_grad()
            armed = tm.supervised_attention(model, (0, 1), x, identity=True)
            h = mm.embed_tokens(x).detach()
            tm.run_stack(mm.layers[:1], h, mm.rotary_emb(h, torch.arange(48)[None]))
            loss = armed[0].supervise["identity_loss"] + armed[0].supervise["loss"]
            first = loss.item() if first is None else first
            loss.backward()
            assert mm.embed_tokens.weight.grad is None
            opt.step()
            tm.supervised_attention(model, (0, 1), None)
        assert loss.item() < 0.6 * first
    finally:
        tm.unpatch(orig)


def test_supervision_spec_refuses_bad_values(tm):
    ns = types.SimpleNamespace
    assert tm.supervision_spec(ns(supervise_induction=None)) is None
    assert tm.supervision_spec(ns(supervise_induction="0,1"), 6) == (0, 1)
    for bad in ("0", "a,b", "0,1,2", "1,0", "0,6"):
        with pytest.raises(SystemExit, match="--supervise-induction"):
            tm.supervision_spec(ns(supervise_induction=bad), 6)


# A 2-layer model the circuit tests train in seconds, and a tokenizer with nothing but a size.
_CIRCUIT_TINY = {"context": 64, "short-context": 32, "layers": 2, "hidden": 32, "experts": 4, "top-k": 2}
_CIRCUIT_TINY |= {"expert-inter": 16, "dense-inter": 32, "supervise-induction": "0,1", "circuit-lr": 1e-2}
CIRCUIT_TINY = [f"--{k}={v}" for k, v in _CIRCUIT_TINY.items()]


class SizeOnlyTok:
    def token_to_id(self, s):
        return 0

    def get_vocab_size(self):
        return 300


def _circuit_run(tm, work: Path, *flags: str) -> tuple[dict, list[dict]]:
    """Run (or resume) the circuit phase of the tiny model in WORK: (the saved state, its history)."""
    args = tm.parse(["train", "--work", str(work), *CIRCUIT_TINY, *flags, "--quiet-file", str(work / "Q")])
    work.mkdir(exist_ok=True)
    last = work / "last.pt"
    state = torch.load(last, weights_only=False) if last.exists() else tm.new_state(args, SizeOnlyTok())
    orig = tm.patch_for_training()
    try:
        tm.train_circuit(state, work, SizeOnlyTok(), args, lambda m: None)
    finally:
        tm.unpatch(orig)
    rows = [json.loads(line) for line in (work / "circuit_history.jsonl").read_text().splitlines()]
    return torch.load(last, weights_only=False), rows


def _tiny_start(tm, tmp_path: Path) -> dict:
    return tm.new_state(tm.parse(["train", "--work", str(tmp_path), *CIRCUIT_TINY]), SizeOnlyTok())["model"]


def test_circuit_phase_trains_only_the_circuit_and_resumes(tm, tmp_path):
    """--circuit-steps: the circuit phase changes layers A..B-1 and layer B's attention and nothing
    else, cycles its window lengths, lowers the supervision losses, and a run stopped half way and
    resumed ends with the same weights as one run straight through."""
    flags = ("--circuit-steps", "40", "--circuit-contexts", "32,64", "--stop-after")
    start = _tiny_start(tm, tmp_path)
    straight, rows = _circuit_run(tm, tmp_path / "a", *flags, "100")
    assert _circuit_run(tm, tmp_path / "b", *flags, "20")[0]["circuit_step"] == 20
    resumed, _ = _circuit_run(tm, tmp_path / "b", *flags, "100")
    assert straight["circuit_step"] == resumed["circuit_step"] == 40
    for k, v in straight["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
        if k == "model.embed_tokens.weight":  # one vector added to every row, the rows kept
            delta = v - start[k]
            assert delta.abs().max() > 0 and torch.allclose(delta, delta[:1].expand_as(delta), atol=1e-6)
            continue
        circuit = ("model.layers.0.", "model.layers.1.self_attn.", "model.layers.1.input_layernorm")
        trained = k.startswith(circuit) and ".indexer." not in k and "1.self_attn.o_proj" not in k
        assert torch.equal(v, start[k]) != trained or "e_score_correction_bias" in k, k
    assert [r["context"] for r in rows[:4]] == [32, 64, 32, 64]
    first, last = rows[:4], rows[-4:]
    total = lambda rows, key: sum(r[key] for r in rows)  # noqa: E731
    assert total(last, "previous_token_loss") < 0.8 * total(first, "previous_token_loss")
    assert total(last, "induction_loss") < total(first, "induction_loss")


def test_circuit_readout_trains_the_heads_write(tm, tmp_path):
    """--circuit-readout: the induction head's write alone, through the final norm and the output
    head, is scored against the copied tokens; its loss is recorded, falls when the circuit is
    trained on it, and it is what lets layer B's output projection move (the head stays fixed)."""
    start = _tiny_start(tm, tmp_path)
    flags = ("--circuit-steps", "40", "--circuit-contexts", "64", "--circuit-readout", "1.0")
    state, rows = _circuit_run(tm, tmp_path / "w", *flags)
    assert all(r["readout_loss"] is not None for r in rows)
    assert sum(r["readout_loss"] for r in rows[-5:]) < sum(r["readout_loss"] for r in rows[:5])
    key = "model.layers.1.self_attn.o_proj.weight"
    assert not torch.equal(state["model"][key], start[key])
    mlp = [k for k in start if k.startswith("model.layers.1.mlp.") and start[k].is_floating_point()]
    assert mlp
    for k in ("lm_head.weight", "model.norm.weight", *mlp):
        assert torch.equal(state["model"][k], start[k]), k


def test_circuit_readout_via_layer_trains_layer_bs_mlp(tm, tmp_path):
    """--circuit-readout-via layer: the readout reads layer B's whole output (attention, then its
    MoE MLP), so the MLP trains with it (what can learn the embedding-to-head lookup no linear
    map makes: only the readout's gradient reaches that MLP, the attention losses are computed
    before it); the output head and the final norm stay. Switched on in the middle of a phase
    (more tensors to train than the saved optimizer knows), the phase's optimizer starts afresh
    instead of failing to load."""
    start = _tiny_start(tm, tmp_path)
    flags = ("--circuit-steps", "60", "--circuit-contexts", "64", "--circuit-readout", "1.0")
    _circuit_run(tm, tmp_path / "w", *flags, "--stop-after", "20")
    state, rows = _circuit_run(tm, tmp_path / "w", *flags, "--circuit-readout-via", "layer")
    assert len(rows) == 60 and all(r["readout_loss"] is not None for r in rows)
    mlp = [k for k in start if k.startswith("model.layers.1.mlp.") and start[k].is_floating_point()]
    moved = [k for k in mlp if not torch.equal(state["model"][k], start[k])]
    assert any(".experts." in k or "shared" in k for k in moved), moved
    for k in ("lm_head.weight", "model.norm.weight"):
        assert torch.equal(state["model"][k], start[k]), k


def test_circuit_flags_refuse_bad_values(tm, tmp_path):
    """A circuit phase without the circuit's layers, or window lengths that are not lengths, stop
    with one line before any training."""
    ok = tm.parse(["train", "--work", str(tmp_path), *CIRCUIT_TINY, "--circuit-contexts", "512,4096"])
    assert tm.circuit_contexts(ok) == [512, 4096]
    for flags, match in (
        (["--circuit-steps", "10"], "--supervise-induction"),
        (["--supervise-induction", "0,1", "--circuit-contexts", "512,abc"], "--circuit-contexts"),
        (["--supervise-induction", "0,1", "--circuit-contexts", "8192"], "--circuit-contexts"),
    ):
        with pytest.raises(SystemExit, match=match):
            tm.circuit_contexts(tm.parse(["train", "--work", str(tmp_path), *flags]))
