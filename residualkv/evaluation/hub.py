"""LongBench / RULER / SCBench from the Hugging Face hub (for users who are online), mapped to `Sample`.

One mapping function per field layout, shared by the hub loader and by local files in the same layout
(JSON/JSONL/parquet through `datasets`), so the mapping is tested offline on small fixtures:

  longbench     THUDM/LongBench (v1), config = subset (e.g. "hotpotqa"), split "test":
                {"input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"}
                -> question = input, answers = alternatives (metric "any"), max_new_tokens from LongBench's
                dataset2maxlen. LongBench's own metrics (F1, ROUGE, edit similarity) are not reproduced:
                this is string match, comparable across cache methods on the same inputs, not to the paper.
  longbench-v2  THUDM/LongBench-v2, split "train": {"_id", "question", "choice_A".."choice_D", "answer", "context"}
                -> a multiple-choice prompt, answer "(X)" string-matched.
  ruler         RULER as packaged for kvpress, simonjegou/ruler, data_dir = context length (e.g. "4096"),
                split "test": {"context", "question", "answer_prefix", "answer" (list), "task", "max_new_tokens"}
                -> metric "all" (string_match_all), as RULER scores its retrieval/aggregation tasks.
  scbench       microsoft/SCBench, config e.g. "scbench_kv" / "multi_turn_kv", split "train":
                {"id", "context", "multi_turns": [{"input", "answer", "options"?}]} -> one sample per turn
                over the shared context (each turn is scored independently; the shared-context
                multi-turn protocol of SCBench is not reproduced).
`datasets` loading scripts are not supported by datasets 5: where a hub repository only ships a script,
point `path` at a parquet mirror with the same fields (e.g. LongBench: "longbench:hotpotqa@<owner>/<repo>").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from ..config import InputError
from ..paths import hub_unreachable
from .samples import DEFAULT_MAX_NEW_TOKENS, Sample

# https://github.com/THUDM/LongBench/blob/main/LongBench/config/dataset2maxlen.json
LONGBENCH_MAXLEN = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32,
    "2wikimqa": 32, "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512,
    "vcsum": 512, "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32,
    "passage_retrieval_en": 32, "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}


def from_longbench(row: dict[str, Any], index: int, subset: str | None = None) -> list[Sample]:
    task = str(row.get("dataset") or subset or "longbench").removesuffix("_e")
    question = str(row.get("input") or "")
    answers = row["answers"] if isinstance(row["answers"], list) else [row["answers"]]
    return [Sample(id=str(row.get("_id") or f"{task}-{index}"), task=f"longbench/{task}", context=str(row["context"]),
                   question=f"Question: {question}" if question else "", answers=[str(a) for a in answers],
                   max_new_tokens=LONGBENCH_MAXLEN.get(task, DEFAULT_MAX_NEW_TOKENS), answer_prefix="Answer:",
                   metric="any")]


def from_longbench_v2(row: dict[str, Any], index: int, subset: str | None = None) -> list[Sample]:
    choices = "\n".join(f"({c}) {row[f'choice_{c}']}" for c in "ABCD")
    q = f"Question: {row['question']}\n\nChoices:\n{choices}\n\nAnswer with the letter of the correct choice."
    task = str(row.get("domain") or "longbench-v2")
    return [Sample(id=str(row.get("_id") or index), task=f"longbench-v2/{task}", context=str(row["context"]),
                   question=q, answers=[f"({row['answer']})"], max_new_tokens=8, answer_prefix="The correct answer is ",
                   metric="any")]


def from_ruler(row: dict[str, Any], index: int, subset: str | None = None) -> list[Sample]:
    answers = row["answer"] if isinstance(row["answer"], list) else [row["answer"]]
    task = str(row.get("task") or subset or "ruler")
    return [Sample(id=str(row.get("id") or f"{task}-{index}"), task=f"ruler/{task}", context=str(row["context"]),
                   question=str(row.get("question") or ""), answers=[str(a) for a in answers],
                   max_new_tokens=int(row.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS),
                   answer_prefix=str(row.get("answer_prefix") or ""), metric="all",
                   # without a budget of its own the harness raises the default to fit the answers
                   max_new_tokens_given=bool(row.get("max_new_tokens")))]


def from_scbench(row: dict[str, Any], index: int, subset: str | None = None) -> list[Sample]:
    context = row["context"]
    if isinstance(context, list):  # multi_turn_mf: a list of numbers
        context = ", ".join(str(x) for x in context)
    task = f"scbench/{subset or 'scbench'}"
    out = []
    for t, turn in enumerate(row["multi_turns"]):
        question = str(turn["input"])
        if turn.get("options"):
            question += "\n" + "\n".join(str(o) for o in turn["options"])
        answer = turn["answer"]
        answers = [str(a) for a in answer] if isinstance(answer, list) else [str(answer)]
        out.append(Sample(id=f"{row.get('id', index)}-{t}", task=task, context=str(context), question=question,
                          answers=answers, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, metric="all",
                          max_new_tokens_given=False))  # a UUID answer alone is ~37 tokens: fitted by the harness
    return out


@dataclass(frozen=True)
class HubSource:
    path: str
    split: str
    mapper: Callable[[dict[str, Any], int, str | None], list[Sample]]
    subset_is_data_dir: bool = False


SOURCES: dict[str, HubSource] = {
    "longbench": HubSource("THUDM/LongBench", "test", from_longbench),
    "longbench-v2": HubSource("THUDM/LongBench-v2", "train", from_longbench_v2),
    "ruler": HubSource("simonjegou/ruler", "test", from_ruler, subset_is_data_dir=True),
    "scbench": HubSource("microsoft/SCBench", "train", from_scbench),
}


def rows_to_samples(rows: Iterable[dict[str, Any]], source: str, subset: str | None = None,
                    limit: int | None = None) -> list[Sample]:
    """Map rows in `source`'s field layout to samples (the function the hub and local loaders share)."""
    if source not in SOURCES:
        raise InputError(f"unknown benchmark {source!r}; known: {', '.join(SOURCES)}")
    mapper = SOURCES[source].mapper
    out: list[Sample] = []
    for i, row in enumerate(rows):
        try:
            out.extend(mapper(dict(row), i, subset))
        except KeyError as e:
            raise InputError(f"{source} row {i} lacks field {e.args[0]!r}: is this file in {source}'s layout?") from None
        if limit is not None and len(out) >= limit:
            return out[:limit]
    return out


def load_benchmark(source: str, subset: str | None = None, *, path: str | None = None, split: str | None = None,
                   data_files: str | Path | list[str] | None = None, limit: int | None = None) -> list[Sample]:
    """Samples of a hub benchmark, or of local `data_files` (JSON/JSONL/parquet) in the same layout."""
    import datasets

    if source not in SOURCES:
        raise InputError(f"unknown benchmark {source!r}; known: {', '.join(SOURCES)}")
    spec = SOURCES[source]
    if data_files is not None:
        files = [str(f) for f in data_files] if isinstance(data_files, list) else [str(data_files)]
        builder = "parquet" if all(f.endswith(".parquet") for f in files) else "json"
        ds = datasets.load_dataset(builder, data_files=files, split="train")
    else:
        kwargs: dict[str, Any] = {"split": split or spec.split}
        if subset is not None:
            kwargs["data_dir" if spec.subset_is_data_dir else "name"] = subset
        fallback = "Offline, use --suite synthetic or --tasks FILE.jsonl"
        if offline := hub_unreachable(path or spec.path):
            raise InputError(f"could not load {path or spec.path} ({subset or 'default'}): the hub is unreachable "
                             f"({offline}). {fallback}; a dataset already in the datasets cache loads with "
                             "HF_HUB_OFFLINE=1.")
        try:
            ds = datasets.load_dataset(path or spec.path, **kwargs)
        except Exception as e:  # gated, renamed, or a script-only repository
            raise InputError(f"could not load {path or spec.path} ({subset or 'default'}) from the hub: {e}. "
                             f"{fallback}; for a script-only repository pass a parquet mirror with the same fields "
                             f"as {source}:SUBSET@OWNER/REPO") from e
    return rows_to_samples(ds, source, subset, limit)


def parse_suite(name: str) -> tuple[str, str | None, str | None] | None:
    """'longbench:hotpotqa@owner/repo' -> ('longbench', 'hotpotqa', 'owner/repo'); None if not a hub suite."""
    head, _, repo = name.partition("@")
    source, _, subset = head.partition(":")
    if source not in SOURCES:
        return None
    return source, subset or None, repo or None
