"""The one sample format every task reduces to, the user JSONL loader, and prompt encoding.

A sample is {"id", "context", "question", "answers"} plus optional "max_new_tokens" (default 32),
"answer_prefix" (text the assistant turn starts with, as RULER does), "metric" ("all": the fraction of
answers found in the prediction, RULER's string_match_all; "any": 1 if one of them is found, for
answer lists that are alternatives, as in LongBench) and "task" (groups samples in the results).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..config import InputError

DEFAULT_MAX_NEW_TOKENS = 32


class TaskFileError(InputError):
    """A task file or one of its rows cannot be used; the message names the file, the line and the fix."""
METRICS = ("all", "any")


@dataclass
class Sample:
    id: str
    task: str
    context: str
    question: str
    answers: list[str]
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    answer_prefix: str = ""
    metric: str = "all"
    max_new_tokens_given: bool = True  # False: the default applied, the harness may raise it to fit the answers
    answer_sep: str = ", "  # how the gold answer for answer_nll joins several answers (the task's own format)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.answers, str):
            self.answers = [self.answers]
        self.answers = [str(a) for a in self.answers]
        if not self.answers or any(not a.strip() for a in self.answers):
            # an empty answer is a substring of every prediction: it would score 1 for any method
            raise TaskFileError(f"sample {self.id}: answers {self.answers!r} hold an empty answer; give each "
                                "answer as non-empty text")
        if self.metric not in METRICS:
            raise TaskFileError(f"sample {self.id}: metric {self.metric!r} is not one of {METRICS}")
        if int(self.max_new_tokens) < 1:
            raise TaskFileError(f"sample {self.id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.max_new_tokens = int(self.max_new_tokens)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_REQUIRED = ("id", "context", "question", "answers")


def sample_from_dict(row: dict[str, Any], *, task: str = "jsonl", where: str = "") -> Sample:
    missing = [k for k in _REQUIRED if k not in row]
    if missing:
        raise TaskFileError(f"{where}: missing field(s) {missing}; a task row is "
                         '{"id", "context", "question", "answers"} (+ optional "max_new_tokens", "answer_prefix", '
                         '"metric", "task")')
    answers = row["answers"]
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not answers:
        raise TaskFileError(f"{where}: answers must be a non-empty list of strings (or one string)")
    given = row.get("max_new_tokens") is not None
    return Sample(id=str(row["id"]), task=str(row.get("task") or task), context=str(row["context"]),
                  question=str(row["question"]), answers=[str(a) for a in answers],
                  max_new_tokens=int(row["max_new_tokens"]) if given else DEFAULT_MAX_NEW_TOKENS,
                  answer_prefix=str(row.get("answer_prefix") or ""), metric=str(row.get("metric") or "all"),
                  max_new_tokens_given=given)


def load_jsonl(path: str | Path, task: str | None = None) -> list[Sample]:
    """Samples from a JSONL file, one object per line; `task` defaults to the file stem."""
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(f"no task file at {path}: give a JSONL file, one object per line with "
                            '"id", "context", "question" and "answers"')
    from ..data import iter_jsonl

    out, seen = [], set()
    for n, row in iter_jsonl(path):
        s = sample_from_dict(row, task=task or path.stem, where=f"{path}:{n}")
        if s.id in seen:
            raise TaskFileError(f"{path}:{n}: duplicate id {s.id!r}")
        seen.add(s.id)
        out.append(s)
    if not out:
        raise TaskFileError(f"{path} holds no samples")
    return out


def write_jsonl(samples: Iterable[Sample | dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s.to_dict() if isinstance(s, Sample) else s, ensure_ascii=False) + "\n")
    return path


# ---- prompts ----

def user_message(sample: Sample) -> str:
    parts = [p for p in (sample.context.strip("\n"), sample.question.strip("\n")) if p.strip()]
    return "\n\n".join(parts)


def prompt_text(tokenizer, sample: Sample) -> str:
    """The text the model is prefilled with: the chat template when the tokenizer has one."""
    message = user_message(sample)
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                             add_generation_prompt=True)
        return text + sample.answer_prefix
    return message + ("\n\n" + sample.answer_prefix if sample.answer_prefix else "\n\nAnswer:")


def tokenize_prompt(tokenizer, sample: Sample, offsets: bool = False):
    """The prompt's text and its encoding (with character offsets when asked): the one rule for how a
    prompt becomes tokens, shared by the harness and the diagnostics that map answers to positions."""
    text = prompt_text(tokenizer, sample)
    # a chat template already writes its special tokens as text; adding them again would double the BOS
    special = not getattr(tokenizer, "chat_template", None)
    return text, tokenizer(text, add_special_tokens=special, return_offsets_mapping=offsets)


def encode_prompt(tokenizer, sample: Sample) -> list[int]:
    return tokenize_prompt(tokenizer, sample)[1].input_ids


def gold_answer_ids(tokenizer, sample: Sample) -> list[int]:
    """The tokens of a correct answer written straight after the prompt, for the teacher-forced answer NLL:
    every answer, joined by the sample's answer_sep (", " unless its task writes them otherwise), for "all";
    the first one for "any". A space first where the prompt ends in a word (an answer prefix, "Answer:"),
    none after a chat template's newline or an opening quote or bracket (kv retrieval's prefix ends in '"')."""
    text = (sample.answer_sep.join(a.strip() for a in sample.answers) if sample.metric == "all"
            else sample.answers[0].strip())
    last = prompt_text(tokenizer, sample)[-1:]
    sep = " " if last.strip() and last not in "\"'([{“‘" else ""
    return tokenizer(sep + text, add_special_tokens=False).input_ids


# The gold answer above changed on 2026-12-06 for two synthetic tasks: no space after kv retrieval's opening
# quote (fe5befe), variable tracking's names space-separated (15c2bcf). Records written since carry inputs_sha
# (751fbcf, the same hour, before any result of that day); older records of these tasks scored another answer.
GOLD_CHANGED_TASKS = frozenset({"kv_retrieval", "vt"})


def gold_basis(record: dict[str, Any]) -> str:
    """Which gold answer a predictions record's answer_nll scored: answer NLLs pair only within one basis."""
    legacy = record.get("task") in GOLD_CHANGED_TASKS and not record.get("inputs_sha")
    return "before 2026-12-06" if legacy else "current"


def generation_budget(tokenizer, sample: Sample, floor: int | None = None) -> int:
    """New tokens to allow: the sample's max_new_tokens, never less; when the sample did not set one,
    raised to fit its longest answer (plus a little room) so a correct answer is never cut off."""
    n = sample.max_new_tokens
    if not sample.max_new_tokens_given:
        lengths = [len(tokenizer(" " + a, add_special_tokens=False).input_ids) for a in sample.answers]
        need = sum(lengths) + 2 * len(lengths) if sample.metric == "all" else max(lengths) + 4
        n = max(n, need)
    if floor is not None:
        n = max(n, floor)
    return n
