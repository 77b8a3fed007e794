"""lm-evaluation-harness against the live server agrees with the in-process scorer.

`lm_eval --model local-completions` with `tokenized_requests=True` (batches of token-id lists,
echo + logprobs, entry 0 null) and `tokenizer_backend=remote` (the server's /tokenize,
/detokenize, /tokenizer_info) runs the next-line multiple-choice task offline; every choice's
log-likelihood (within float32 rounding) and the accuracy must equal `latentkv.eval.mc.score_items`
on the same items.

The task is the shipped one (src/latentkv/eval/tasks/nextline) when it exists; until then the
same builder (`mc.build_items`, `mc.task_yaml`) makes one from a source file of this package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from latentkv.config import CacheConfig
from latentkv.eval import mc
from latentkv.models.weights import load_model
from latentkv.tokenizer import Tokenizer

LIMIT = 8
# A choice's log-likelihood sums ~50 token logprobs: the server's are float32 log_softmax over a
# batched prefill, the scorer's float64 over its own passes; they agree to ~1e-6 relative.
REL = 1e-5


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    if mc.TASK_FILE.exists() and (mc.TASK_DIR / "nextline.yaml").exists():
        return mc.TASK_DIR
    directory = tmp_path_factory.mktemp("nextline")
    text = Path(mc.__file__).read_text(encoding="utf-8") + Path(json.__file__).read_text(encoding="utf-8")
    items = mc.build_items(text, mc.BuildConfig(items=LIMIT, seed=3, context_chars=200))
    mc.write_jsonl(items, directory / "nextline.jsonl")
    (directory / "nextline.yaml").write_text(
        mc.task_yaml("nextline.jsonl", "built by tests/server/test_lm_eval.py")
    )
    return directory


@pytest.fixture(scope="module")
def server(tmp_path_factory, serve):
    root = tmp_path_factory.mktemp("lm-eval")
    live = serve("builtin:tiny", root / "server.log", "--max-num-seqs", "4")
    yield live
    live.stop()


def _run_lm_eval(server, task_dir: Path, out: Path) -> dict:
    model_args = ",".join(
        [
            "model=builtin:tiny",
            f"base_url={server.url}/v1/completions",
            "tokenized_requests=True",
            "tokenizer_backend=remote",
            f"auth_token={server.key}",
            "max_retries=1",
        ]
    )
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
    cmd += ["--tasks", mc.TASK_NAME, "--include_path", ".", "--limit", str(LIMIT), "--batch_size", "4"]
    cmd += ["--output_path", str(out), "--log_samples"]
    env = {**os.environ, "OPENAI_API_KEY": server.key, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(out / "hf-datasets")
    done = subprocess.run(cmd, cwd=task_dir, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [results] = list(out.rglob("results_*.json"))
    [samples] = list(out.rglob(f"samples_{mc.TASK_NAME}_*.jsonl"))
    lines = samples.read_text().splitlines()
    return {
        "acc": json.loads(results.read_text())["results"][mc.TASK_NAME]["acc,none"],
        "samples": sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"]),
    }


def test_lm_eval_through_the_server_scores_like_the_in_process_scorer(server, task_dir, tiny_dir, tmp_path):
    got = _run_lm_eval(server, task_dir, tmp_path / "lm-eval")
    items = mc.load_items(task_dir / "nextline.jsonl", limit=LIMIT)
    expected = mc.score_items(load_model(tiny_dir), Tokenizer(tiny_dir), items, CacheConfig())
    assert len(got["samples"]) == len(items) == LIMIT
    for sample, result in zip(got["samples"], expected, strict=True):
        lls = [float(resp[0]) for resp in sample["filtered_resps"]]
        # the choices after the context, then alone (acc_mutual_info); the latter's prefix token is
        # lm_eval's backend's choice (the remote tokenizer takes `bos or eos`: EOS for tiny's BOS id 0)
        assert len(lls) == 2 * len(result.loglikelihoods)
        assert lls[: len(result.loglikelihoods)] == pytest.approx(list(result.loglikelihoods), rel=REL)
    correct = sum(r.pred == item.answer for r, item in zip(expected, items, strict=True))
    assert got["acc"] == pytest.approx(correct / len(items))
