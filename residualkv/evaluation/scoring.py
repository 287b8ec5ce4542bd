"""String-match scoring (RULER's metrics), case-insensitive substring tests on the generated text.

- "all": the fraction of the reference answers present in the prediction (RULER string_match_all,
  the "all answers present" recall used for NIAH, variable tracking and word extraction);
- "any": 1 when at least one reference is present (RULER string_match_part; LongBench-style answer
  lists of alternatives).
Scores are fractions in [0, 1]. Whitespace runs count as one space on both sides ("New\nYork" holds
"New York"). A substring test, as RULER's: a word inside a longer one counts ("form" in "formation"),
which its common-word task can credit by chance; kept so scores read like published RULER figures.
"""

from __future__ import annotations

from typing import Sequence


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def match_all(prediction: str, answers: Sequence[str]) -> float:
    pred = _norm(prediction)
    return sum(_norm(a) in pred for a in answers) / len(answers) if answers else 0.0


def match_any(prediction: str, answers: Sequence[str]) -> float:
    pred = _norm(prediction)
    return float(any(_norm(a) in pred for a in answers))


def score(prediction: str, answers: Sequence[str], metric: str = "all") -> float:
    if metric == "all":
        return match_all(prediction, answers)
    if metric == "any":
        return match_any(prediction, answers)
    raise ValueError(f"unknown metric {metric!r}; use 'all' or 'any'")
