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


def _server_args(server) -> str:
    return ",".join(
        [
            "model=builtin:tiny",
            f"base_url={server.url}/v1/completions",
            "tokenized_requests=True",
            "tokenizer_backend=remote",
            f"auth_token={server.key}",
            "max_retries=1",
        ]
    )


def _lm_eval(
    command: list[str],
    model: str,
    model_args: str,
    tasks: list[str],
    task_dir: Path,
    out: Path,
    key: str = "",
) -> dict:
    """Run lm_eval (`command`: how to start it) on `tasks`; {task: {"results", "samples"}}."""
    cmd = [*command, "--model", model, "--model_args", model_args, "--tasks", ",".join(tasks)]
    cmd += ["--include_path", ".", "--limit", str(LIMIT), "--batch_size", "4"]
    cmd += ["--output_path", str(out), "--log_samples"]
    env = {**os.environ, "OPENAI_API_KEY": key, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    env["HF_DATASETS_CACHE"] = str(out / "hf-datasets")
    done = subprocess.run(cmd, cwd=task_dir, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [results] = list(out.rglob("results_*.json"))
    got = {}
    for task in tasks:
        [samples] = list(out.rglob(f"samples_{task}_*.jsonl"))
        lines = samples.read_text().splitlines()
        got[task] = {
            "results": json.loads(results.read_text())["results"][task],
            "samples": sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"]),
        }
    return got


def _run_lm_eval(server, task_dir: Path, out: Path) -> dict:
    got = _lm_eval(
        [sys.executable, "-m", "lm_eval"],
        "local-completions",
        _server_args(server),
        [mc.TASK_NAME],
        task_dir,
        out,
        server.key,
    )[mc.TASK_NAME]
    return {"acc": got["results"]["acc,none"], "samples": got["samples"]}


def test_lm_eval_through_the_server_scores_like_the_in_process_scorer(server, task_dir, tiny_dir, tmp_path):
    got = _run_lm_eval(server, task_dir, tmp_path / "lm-eval")
    items = mc.load_items(task_dir / "nextline.jsonl", limit=LIMIT)
    expected = mc.score_items(load_model(tiny_dir, device="cpu"), Tokenizer(tiny_dir), items, CacheConfig())
    assert len(got["samples"]) == len(items) == LIMIT
    for sample, result in zip(got["samples"], expected, strict=True):
        lls = [float(resp[0]) for resp in sample["filtered_resps"]]
        # the choices after the context, then alone (acc_mutual_info); the latter's prefix token is
        # lm_eval's backend's choice (the remote tokenizer takes `bos or eos`: EOS for tiny's BOS id 0)
        assert len(lls) == 2 * len(result.loglikelihoods)
        assert lls[: len(result.loglikelihoods)] == pytest.approx(list(result.loglikelihoods), rel=REL)
    correct = sum(r.pred == item.answer for r, item in zip(expected, items, strict=True))
    assert got["acc"] == pytest.approx(correct / len(items))


EXTRA_TASKS = {
    # the context as one text to score whole (perplexity tasks: wikitext's shape)
    "latentkv_test_rolling": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{context}}"
metric_list:
  - metric: word_perplexity
""",
    # greedy generation of the next line, stopped at the newline
    "latentkv_test_generate": """
output_type: generate_until
doc_to_text: "{{context}}"
doc_to_target: "{{choices[answer]}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def all_tasks(task_dir, tmp_path_factory) -> Path:
    """The next-line task and two more over its items: a rolling log-likelihood and a generation."""
    directory = tmp_path_factory.mktemp("tasks")
    (directory / "nextline.jsonl").write_text((task_dir / "nextline.jsonl").read_text())
    (directory / "nextline.yaml").write_text((task_dir / "nextline.yaml").read_text())
    head = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: nextline.jsonl\ntest_split: test\n"
    for name, body in EXTRA_TASKS.items():
        (directory / f"{name}.yaml").write_text(f"task: {name}\n{head}{body}metadata:\n  version: 1.0\n")
    return directory


def test_lm_eval_in_process_scores_like_the_server_path(server, all_tasks, tmp_path):
    """`--model latentkv` (this process's engine, registered in lm_eval's registry) and
    `--model local-completions` against the server give the same log-likelihoods (to the bit),
    the same rolling log-likelihoods and the same generations."""
    tasks = [mc.TASK_NAME, *EXTRA_TASKS]
    remote = _lm_eval(
        [sys.executable, "-m", "lm_eval"],
        "local-completions",
        _server_args(server)
        + ",custom_prefix_token_id=0",  # tiny's BOS (lm_eval's remote takes `bos or eos`)
        tasks,
        all_tasks,
        tmp_path / "server",
        server.key,
    )
    local = _lm_eval(
        [sys.executable, "-m", "latentkv.eval.harness"],
        "latentkv",
        "pretrained=builtin:tiny,threads=1",
        tasks,
        all_tasks,
        tmp_path / "local",
    )
    for task in tasks:
        assert len(remote[task]["samples"]) == len(local[task]["samples"]) == LIMIT
    for r, lo in zip(remote[mc.TASK_NAME]["samples"], local[mc.TASK_NAME]["samples"], strict=True):
        assert lo["filtered_resps"] == r["filtered_resps"]  # every choice, after the context and alone
    for r, lo in zip(
        remote["latentkv_test_rolling"]["samples"], local["latentkv_test_rolling"]["samples"], strict=True
    ):
        assert lo["resps"] == r["resps"]
    texts = [s["resps"] for s in local["latentkv_test_generate"]["samples"]]
    assert texts == [s["resps"] for s in remote["latentkv_test_generate"]["samples"]]
    assert any(t[0][0] for t in texts)  # something was generated
