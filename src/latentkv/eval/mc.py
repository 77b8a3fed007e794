"""The "next line" multiple-choice task: build it from held-out code, score it per KV tier.

An item is a few consecutive lines of held-out code (the context), the line that really came
next, and three distractor lines taken from elsewhere in the held-out text, re-indented like the
true line so indentation alone gives nothing away. The JSONL file (`context`, `choices`, `answer`)
and an lm-evaluation-harness task YAML live in `eval/tasks/nextline/`; tools/make_mc_task.py
writes both.

Scoring follows lm_eval's `multiple_choice`: each choice is a request
(context, TARGET_DELIMITER + choice) scored by `loglik.loglikelihood`; the prediction is the
argmax of the summed log-probabilities (acc), of the log-probability per character of the
choice (acc_norm), or of how much the context raises the choice's log-probability over the
choice alone (acc_mutual_info; a small model's raw likelihood mostly ranks lines by how common
they are, this asks whether the context made the line likelier). Accuracies carry Wilson 95%
intervals.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from latentkv.config import CacheConfig
from latentkv.eval import loglik, stats

TASK_DIR = Path(__file__).parent / "tasks" / "nextline"
TASK_FILE = TASK_DIR / "nextline.jsonl"
TARGET_DELIMITER = "\n"  # the YAML's target_delimiter: a choice is the line after the context's last
N_CHOICES = 4
BOUNDARY = "<|endoftext|>"  # heldout.txt joins files with this line; contexts never cross it


@dataclass(frozen=True)
class Item:
    context: str  # the preceding lines, joined by "\n", without a trailing newline
    choices: tuple[str, ...]
    answer: int

    def requests(self) -> list[tuple[str, str]]:
        """lm_eval's (context, continuation) requests for this item, in its order: each choice
        after the context, then each choice alone (the empty context of acc_mutual_info)."""
        conditional = [(self.context, TARGET_DELIMITER + choice) for choice in self.choices]
        return conditional + [("", continuation) for _, continuation in conditional]


# --- building the task -------------------------------------------------------------------


@dataclass(frozen=True)
class BuildConfig:
    items: int = 400
    seed: int = 0
    context_lines: int = 6  # at most this many preceding lines ...
    context_chars: int = 400  # ... and at most this many characters of them
    min_chars: int = 12  # a line with fewer non-blank characters is trivial (e.g. "else:", "])")
    min_distance: int = 50  # distractors come from at least this many lines away

    def __post_init__(self) -> None:
        if self.items < 1 or self.context_lines < 1 or self.context_chars < 1:
            raise ValueError("items, context_lines and context_chars must be positive")


def _substantive(line: str, min_chars: int) -> bool:
    """Not blank, not trivial: enough non-space characters, and at least one letter or digit."""
    core = line.strip()
    return len(core) >= min_chars and re.search(r"[A-Za-z0-9]", core) is not None and core != BOUNDARY


def build_items(text: str, cfg: BuildConfig = BuildConfig()) -> list[dict]:
    """Items from a text (fixed seed): JSON-ready dicts with context, choices, answer and the
    1-based line number of the true line. Lines lose their trailing whitespace. Targets and distractors are substantive lines whose
    stripped text occurs once in the whole text (so no distractor can equal the answer)."""
    lines = [line.rstrip() for line in text.split("\n")]  # trailing blanks would tell the true line apart
    seen = Counter(line.strip() for line in lines)
    usable = [
        i for i, line in enumerate(lines) if _substantive(line, cfg.min_chars) and seen[line.strip()] == 1
    ]
    targets = [i for i in usable if _context(lines, i, cfg)]
    if len(usable) < N_CHOICES + 1 or not targets:
        raise ValueError(f"the text has too few distinct substantive lines ({len(usable)}) for the task")
    rng = random.Random(cfg.seed)
    chosen = sorted(rng.sample(targets, min(cfg.items, len(targets))))
    items = []
    for i in chosen:
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        distractors = _distractors(rng, usable, i, cfg.min_distance)
        choices = [lines[i]] + [indent + lines[j].strip() for j in distractors]
        answer = rng.randrange(N_CHOICES)
        choices[0], choices[answer] = choices[answer], choices[0]
        items.append(
            {"context": _context(lines, i, cfg), "choices": choices, "answer": answer, "line": i + 1}
        )
    return items


def _context(lines: list[str], i: int, cfg: BuildConfig) -> str:
    """Up to context_lines lines before line i, within one file and context_chars characters;
    empty if no substantive line is among them."""
    picked: list[str] = []
    for j in range(i - 1, max(-1, i - 1 - cfg.context_lines), -1):
        if lines[j].strip() == BOUNDARY or len("\n".join([lines[j], *picked])) > cfg.context_chars:
            break
        picked.insert(0, lines[j])
    while picked and not picked[0].strip():  # no leading blank lines
        picked.pop(0)
    if not any(_substantive(line, cfg.min_chars) for line in picked):
        return ""
    return "\n".join(picked)


def _distractors(rng: random.Random, usable: list[int], i: int, min_distance: int) -> list[int]:
    """N_CHOICES - 1 usable lines far from line i with distinct stripped text."""
    far = [j for j in usable if abs(j - i) >= min_distance]
    if len(far) < N_CHOICES - 1:
        far = [j for j in usable if j != i]
    return rng.sample(far, N_CHOICES - 1)


def write_jsonl(items: Sequence[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for k, item in enumerate(items):
            f.write(json.dumps({"id": k, **item}, ensure_ascii=False) + "\n")


TASK_NAME = "latentkv_nextline"


def task_yaml(jsonl_name: str, source: str) -> str:
    """The lm-evaluation-harness task definition for a JSONL file beside it."""
    return f"""\
# latentkv's next-line task: which of 4 lines of Python really follows the context?
# {source}
# `datasets` resolves data_files against the working directory: run lm_eval from this directory
# (--include_path .), or point data_files at the absolute path of {jsonl_name}.
task: {TASK_NAME}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {jsonl_name}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: answer
target_delimiter: {json.dumps(TARGET_DELIMITER)}
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
  - metric: acc_mutual_info
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def load_items(path: Path, limit: int | None = None) -> list[Item]:
    """Items of a task JSONL file (context, choices, answer per line), the first `limit` of them."""
    items = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the task file {path}: {exc.strerror}") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
            item = Item(raw["context"], tuple(raw["choices"]), int(raw["answer"]))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{n}: not a task item ({exc})") from None
        if not 0 <= item.answer < len(item.choices):
            raise ValueError(f"{path}:{n}: answer {item.answer} is not a choice index")
        items.append(item)
    if not items:
        raise ValueError(f"{path} holds no items")
    return items[:limit] if limit else items


# --- scoring -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ItemResult:
    loglikelihoods: tuple[float, ...]  # log p(choice | context)
    unconditional: tuple[float, ...]  # log p(choice | prefix token): the choice alone
    pred: int  # argmax of the log-likelihoods (acc)
    pred_norm: int  # argmax of log-likelihood per character of the choice (acc_norm)
    pred_mi: int  # argmax of log p(choice | context) - log p(choice) (acc_mutual_info)


def score_items(
    model,
    tokenizer,
    items: Sequence[Item],
    cache: CacheConfig,
    progress: Callable[[int], None] | None = None,
) -> list[ItemResult]:
    """Every item's choices under one KV tier."""
    tier = model.tier(cache)
    out = []
    for k, item in enumerate(items):
        scores = [ll for ll, _ in loglik.loglikelihood(model, tokenizer, item.requests(), tier)]
        lls, unconditional = scores[: len(item.choices)], scores[len(item.choices) :]
        norm = [ll / len(choice) for ll, choice in zip(lls, item.choices, strict=True)]
        mi = [c - u for c, u in zip(lls, unconditional, strict=True)]
        out.append(ItemResult(tuple(lls), tuple(unconditional), _argmax(lls), _argmax(norm), _argmax(mi)))
        if progress is not None:
            progress(k + 1)
    return out


def _argmax(values: Sequence[float]) -> int:
    """The first index of the maximum (numpy's argmax tie rule, which lm_eval uses)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


METRICS = {"acc": "pred", "acc_norm": "pred_norm", "acc_mutual_info": "pred_mi"}


def summarize(items: Sequence[Item], results: Sequence[ItemResult], reference=None) -> dict:
    """acc, acc_norm and acc_mutual_info with Wilson 95% intervals; with reference results (f32),
    how often the tier picks the same choice (by acc's rule)."""
    n = len(items)
    row: dict = {"items": n}
    for metric, field in METRICS.items():
        correct = sum(getattr(r, field) == it.answer for it, r in zip(items, results, strict=True))
        row[metric] = correct / n
        row[f"{metric}_ci"] = list(stats.wilson_interval(correct, n))
    if reference is not None:
        row["same_pred_as_f32"] = sum(a.pred == b.pred for a, b in zip(results, reference, strict=True)) / n
    return row
