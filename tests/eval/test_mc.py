"""The next-line task: building it, tokenizing like lm-evaluation-harness, scoring per tier,
and lm_eval itself (in process) reaching the same accuracy as `eval mc` on the same items."""

from __future__ import annotations

import dataclasses
import inspect
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from latentkv.cli import main
from latentkv.config import CacheConfig
from latentkv.eval import loglik, mc
from latentkv.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def code_text() -> str:
    """Two stdlib modules joined like heldout.txt joins its files."""
    import json.decoder
    import textwrap

    return f"\n{mc.BOUNDARY}\n".join(inspect.getsource(m) for m in (json.decoder, textwrap))


# --- building --------------------------------------------------------------------------------


def test_items_are_true_next_lines_among_distinct_substantive_distractors(code_text):
    raw = [line + "  " * (k % 3 == 0) for k, line in enumerate(code_text.split("\n"))]  # trailing blanks
    lines = [line.rstrip() for line in raw]
    items = mc.build_items("\n".join(raw), mc.BuildConfig(items=60, seed=3))
    assert len(items) == 60
    for it in items:
        i = it["line"] - 1
        assert it["choices"][it["answer"]] == lines[i]  # the true next line, less trailing blanks
        ctx_lines = it["context"].split("\n")
        assert lines[i - len(ctx_lines) : i] == ctx_lines  # the lines right before it
        assert mc.BOUNDARY not in it["context"] and len(ctx_lines) <= 6 and len(it["context"]) <= 400
        assert len(it["choices"]) == 4 and len({c.strip() for c in it["choices"]}) == 4
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        for c in it["choices"]:
            assert c.startswith(indent) and len(c.strip()) >= 12  # same indentation; not trivial
            assert c == c.rstrip()
            assert sum(line.strip() == c.strip() for line in lines) == 1  # unique in the text
    assert len({it["answer"] for it in items}) == 4  # the answer moves around


def test_building_is_reproducible(code_text):
    a = mc.build_items(code_text, mc.BuildConfig(items=20, seed=1))
    assert a == mc.build_items(code_text, mc.BuildConfig(items=20, seed=1))
    assert a != mc.build_items(code_text, mc.BuildConfig(items=20, seed=2))


def test_too_little_text_is_refused():
    with pytest.raises(ValueError, match="too few"):
        mc.build_items("x = 1\n\n\n", mc.BuildConfig(items=5))


def test_the_tool_writes_jsonl_and_yaml(code_text, tmp_path):
    heldout = tmp_path / "heldout.txt"
    heldout.write_text(code_text)
    out = tmp_path / "task"
    argv = [sys.executable, str(REPO / "tools" / "make_mc_task.py"), "--heldout", str(heldout)]
    proc = subprocess.run([*argv, "--out-dir", str(out), "--items", "25"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    items = mc.load_items(out / "nextline.jsonl")
    assert len(items) == 25
    expected = mc.build_items(code_text, mc.BuildConfig(items=25))
    assert [(it.context, list(it.choices), it.answer) for it in items] == [
        (e["context"], e["choices"], e["answer"]) for e in expected
    ]
    yaml = (out / "nextline.yaml").read_text()
    assert "output_type: multiple_choice" in yaml and "test: nextline.jsonl" in yaml


def test_load_items_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b", "c"], "answer": 2}\n')
    with pytest.raises(ValueError, match="not a choice index"):
        mc.load_items(bad)
    bad.write_text('{"context": "a"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        mc.load_items(bad)


# --- tokenizing and scoring ------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, checkpoint, code_text) -> Path:
    """dsv3-tiny with a BPE tokenizer trained on the text, without a pre-tokenizer, so merges
    span spaces and newlines: tok(context) + tok(continuation) often differs from
    tok(context + continuation), which is what lm_eval's split has to get right."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, trainers

    directory = tmp_path_factory.mktemp("bpe-model")
    for f in checkpoint("dsv3-tiny").iterdir():
        shutil.copy(f, directory)
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.BPEDecoder()
    trainer = trainers.BpeTrainer(vocab_size=250, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(code_text.split("\n\n"), trainer=trainer)
    assert tok.get_vocab_size() <= 256  # dsv3-tiny's vocabulary
    (directory / "tokenizer.json").write_text(tok.to_str())
    return directory


@pytest.mark.parametrize("prefix", [1, 2])  # 2: a choice that starts with the prefix token
def test_encode_pair_is_lm_evals(bpe_dir, code_text, prefix):
    from lm_eval.api.model import TemplateLM

    tok = Tokenizer(bpe_dir)

    class Harness(TemplateLM):  # lm_eval's own loglikelihood -> _encode_pair over our tokenizer
        eot_token_id = prefix  # lm_eval's prefix_token_id for an empty context

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return tok.encode(string, add_special_tokens=False)

        def _loglikelihood_tokens(self, requests, **kwargs):  # hand back the tokens, unscored
            return [(ctx, cont) for _, ctx, cont in requests]

        loglikelihood_rolling = generate_until = None

    pairs = [p for it in mc.build_items(code_text, mc.BuildConfig(items=40)) for p in _requests(it)]
    pairs += [("x = 1 \n", "y"), ("def f():\n    ", "return 2"), ("a\t", " b")]  # trailing whitespace
    pairs += [("", tok.decode([2, 40, 41])), ("", "\n    return x")]  # empty contexts
    theirs = Harness().loglikelihood([SimpleNamespace(args=p) for p in pairs], disable_tqdm=True)
    differs = 0
    for (context, continuation), (ctx, cont) in zip(pairs, theirs, strict=True):
        ours = loglik.encode_pair(tok, context, continuation, prefix)
        assert ours == (ctx, cont)
        differs += ours[0] + ours[1] != tok.encode(context) + tok.encode(continuation)
    assert differs > 0  # the merges really cross the split somewhere


def _requests(item: dict) -> list[tuple[str, str]]:
    return mc.Item(item["context"], tuple(item["choices"]), item["answer"]).requests()


def _one_pass(model, ctx: list[int], cont: list[int], tier: CacheConfig) -> float:
    """log p(cont | ctx) from a single forward over ctx + cont[:-1], as lm_eval's backends score it."""
    ids = torch.tensor(ctx + cont)
    logits = model.forward(ids[:-1], model.make_cache(model.tier(tier)), all_logits=True)[-len(cont) :]
    return float(torch.log_softmax(logits.double(), -1)[torch.arange(len(cont)), torch.tensor(cont)].sum())


def _decoded(model, ctx: list[int], cont: list[int], tier: CacheConfig) -> float:
    """The reference: log p(cont | ctx) from decoding ctx + cont[:-1] one token at a time over the tier."""
    cache, ids = model.make_cache(model.tier(tier)), ctx + cont
    logits = torch.cat([model.forward(torch.tensor(ids[t : t + 1]), cache) for t in range(len(ids) - 1)])
    log_p = torch.log_softmax(logits[-len(cont) :].double(), -1)
    return float(log_p[torch.arange(len(cont)), torch.tensor(cont)].sum())


@pytest.mark.parametrize("tier", ["f32", "tq4"])
def test_loglikelihood_equals_token_by_token_decode_over_the_tier(tier, ours, bpe_dir, code_text):
    model, tok = ours("dsv3-tiny"), Tokenizer(bpe_dir)
    items = mc.build_items(code_text, mc.BuildConfig(items=1, seed=5, context_chars=150))
    pairs = [p for it in items for p in _requests(it)]
    got = loglik.loglikelihood(model, tok, pairs, model.tier(tier))
    assert len(got) == len(pairs) == 8  # 4 choices after the context, 4 alone
    for (context, continuation), (ll, _) in zip(pairs, got, strict=True):
        ctx, cont = loglik.encode_pair(tok, context, continuation, loglik.prefix_token(model.cfg))
        assert ll == pytest.approx(_decoded(model, ctx, cont, CacheConfig(tier)), abs=1e-3)
        assert ll < 0
    if tier != "f32":  # the tier is in the path
        f32 = loglik.loglikelihood(model, tok, pairs[:1])
        assert abs(f32[0][0] - got[0][0]) > 1e-4


class CharTokenizer:
    """One token per character (its code point): every id sequence below 256 is a string."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_is_greedy_and_truncation(ours):
    model, tok = ours("dsv3-tiny"), CharTokenizer()
    context = "def f(x):"
    cache = model.make_cache()
    logits, greedy = model.forward(torch.tensor(tok.encode(context)), cache)[0], []
    for _ in range(4):
        greedy.append(int(logits.argmax()))
        logits = model.forward(torch.tensor(greedy[-1:]), cache)[0]
    cont = "".join(map(chr, greedy))
    (ll, is_greedy), (_, not_greedy) = loglik.loglikelihood(
        model, tok, [(context, cont), (context, cont[:-1] + chr(greedy[-1] ^ 1))]
    )
    assert is_greedy and not not_greedy
    assert ll == pytest.approx(_one_pass(model, tok.encode(context), greedy, CacheConfig()), abs=1e-4)

    # lm_eval keeps the last max_length + 1 tokens of context + continuation, less the final one
    short = SimpleNamespace(
        cfg=dataclasses.replace(model.cfg, max_position_embeddings=12),
        forward=model.forward,
        make_cache=model.make_cache,
    )
    [(ll, _)] = loglik.loglikelihood(short, tok, [("0123456789abcdef", "wxyz")])
    assert ll == pytest.approx(_one_pass(model, tok.encode("789abcdef"), tok.encode("wxyz"), CacheConfig()))


def test_accuracy_and_wilson_intervals(ours, bpe_dir, code_text):
    model, tok = ours("dsv3-tiny"), Tokenizer(bpe_dir)
    items = [mc.Item(e["context"], tuple(e["choices"]), e["answer"]) for e in mc.build_items(code_text)[:6]]
    results = mc.score_items(model, tok, items, CacheConfig())
    row = mc.summarize(items, results, reference=results)
    assert row["items"] == 6 and row["same_pred_as_f32"] == 1.0
    by_hand = {"acc": 0, "acc_norm": 0, "acc_mutual_info": 0}
    for it, r in zip(items, results, strict=True):
        ll, alone = r.loglikelihoods, r.unconditional
        for (context, continuation), value in zip(it.requests(), ll + alone, strict=True):
            ctx, cont = loglik.encode_pair(tok, context, continuation, loglik.prefix_token(model.cfg))
            assert value == pytest.approx(_one_pass(model, ctx, cont, CacheConfig()), abs=1e-3)
        by_hand["acc"] += _first_max(ll) == it.answer
        by_hand["acc_norm"] += (
            _first_max([v / len(c) for v, c in zip(ll, it.choices, strict=True)]) == it.answer
        )
        by_hand["acc_mutual_info"] += _first_max([c - u for c, u in zip(ll, alone, strict=True)]) == it.answer
    for metric, correct in by_hand.items():
        assert row[metric] == correct / 6
        assert row[f"{metric}_ci"] == list(mc.stats.wilson_interval(correct, 6))


def _first_max(values: list[float]) -> int:
    return values.index(max(values))


def test_lm_eval_reaches_our_accuracy_on_the_same_items(ours, bpe_dir, code_text, tmp_path, monkeypatch):
    """lm_eval loads the task YAML, builds the requests and tokenizes them itself; its LM here
    scores each request by one independent forward pass. Accuracy and every prediction must
    equal `eval mc`'s (which tokenizes through loglik, not lm_eval)."""
    task_dir = tmp_path / "task"
    task_dir.mkdir()
    mc.write_jsonl(mc.build_items(code_text, mc.BuildConfig(items=5, seed=11)), task_dir / "nextline.jsonl")
    (task_dir / "nextline.yaml").write_text(mc.task_yaml("nextline.jsonl", "test"))
    monkeypatch.chdir(task_dir)  # datasets resolves data_files against the working directory
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))  # read when datasets is imported
    model, tok = ours("dsv3-tiny"), Tokenizer(bpe_dir)
    harness = _harness_results(model, tok, task_dir)
    items = mc.load_items(task_dir / "nextline.jsonl")
    results = mc.score_items(model, tok, items, CacheConfig())
    assert [s["arguments"] for s in harness["samples"]] == [it.requests() for it in items]
    assert [s["acc"] for s in harness["samples"]] == [
        float(r.pred == it.answer) for it, r in zip(items, results, strict=True)
    ]
    assert [s["acc_norm"] for s in harness["samples"]] == [
        float(r.pred_norm == it.answer) for it, r in zip(items, results, strict=True)
    ]
    assert [s["acc_mutual_info"] for s in harness["samples"]] == [
        float(r.pred_mi == it.answer) for it, r in zip(items, results, strict=True)
    ]
    ours_row = mc.summarize(items, results)
    for metric in mc.METRICS:
        assert harness[metric] == pytest.approx(ours_row[metric])


def _harness_results(model, tok, task_dir: Path) -> dict:
    from lm_eval import evaluator
    from lm_eval.api.model import TemplateLM
    from lm_eval.tasks import TaskManager

    class Engine(TemplateLM):
        eot_token_id = loglik.prefix_token(model.cfg)  # lm_eval's prefix_token_id defaults to it

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return tok.encode(string, add_special_tokens=False)

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
            out = []
            for _, ctx, cont in requests:
                ll = _one_pass(model, ctx, cont, CacheConfig())
                out.append((ll, False))
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            raise NotImplementedError

        def generate_until(self, requests, disable_tqdm=False):
            raise NotImplementedError

    tasks = TaskManager(include_path=str(task_dir), include_defaults=False).load([mc.TASK_NAME])
    out = evaluator.evaluate(Engine(), tasks, log_samples=True, bootstrap_iters=0, verbosity="ERROR")
    samples = sorted(out["samples"][mc.TASK_NAME], key=lambda s: s["doc_id"])
    metrics = out["results"][mc.TASK_NAME]
    return {
        "samples": [{**s, "arguments": [tuple(a) for a in s["arguments"]]} for s in samples],
        **{metric: metrics[f"{metric},none"] for metric in mc.METRICS},
    }


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_mc_json(capsys, tmp_path, code_text, monkeypatch):
    for name in ("KV8", "KV_TQ", "KV_TQ_POLAR"):
        monkeypatch.delenv(name, raising=False)
    task = tmp_path / "t.jsonl"
    mc.write_jsonl(mc.build_items(code_text, mc.BuildConfig(items=4)), task)
    code = main(["eval", "mc", "builtin:tiny", "--task", str(task), "--kv-cache-dtype", "tq4,f32", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    payload = json.loads(out)
    assert payload["items"] == 4 and [r["tier"] for r in payload["tiers"]] == ["f32", "tq4"]
    for r in payload["tiers"]:
        for metric in ("acc", "acc_norm", "acc_mutual_info"):
            assert 0 <= r[f"{metric}_ci"][0] <= r[metric] <= r[f"{metric}_ci"][1] <= 1
        assert r["items"] == 4
    assert "same_pred_as_f32" in payload["tiers"][1] and "same_pred_as_f32" not in payload["tiers"][0]
    assert main(["eval", "mc", "builtin:tiny", "--task", str(task), "--limit", "2"]) == 0
    assert "| f32 |" in capsys.readouterr().out


def test_cli_mc_missing_task(capsys, tmp_path):
    code = main(["eval", "mc", "builtin:tiny", "--task", str(tmp_path / "none.jsonl")])
    assert code == 2
    assert "no task file" in capsys.readouterr().err


def test_the_bundled_task_is_what_the_tool_builds_from_the_fixture_and_lm_eval_loads_it(
    monkeypatch, tmp_path
):
    from latentkv.models.registry import builtin_path

    items = mc.load_items(mc.TASK_FILE)
    assert len(items) == 400
    heldout = (builtin_path("fixture") / "heldout.txt").read_text(encoding="utf-8")
    built = mc.build_items(heldout)  # the tool's defaults: 400 items, seed 0
    assert [(it.context, list(it.choices), it.answer) for it in items] == [
        (b["context"], b["choices"], b["answer"]) for b in built
    ]
    assert (mc.TASK_DIR / "nextline.yaml").read_text().split("\n")[2:] == mc.task_yaml(
        "nextline.jsonl", ""
    ).split("\n")[2:]  # all but the line naming how it was built

    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(mc.TASK_DIR)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    loaded = TaskManager(include_path=str(mc.TASK_DIR), include_defaults=False).load([mc.TASK_NAME])
    task = loaded["tasks"][mc.TASK_NAME]
    docs = list(task.test_docs())
    assert len(docs) == 400
    for doc, item in zip(docs[:20], items, strict=False):
        requests = task.construct_requests(doc, task.doc_to_text(doc), metadata=(mc.TASK_NAME, 0, 1))
        assert [tuple(r.args) for r in requests] == item.requests()
