"""Pandera schemas for the two tables the pipeline gates on, and a readable failure report.

KR/CR table (one row per method and context length, from `residualkv.accounting.report`):
    method, context_len, kr_measured in (0, 1.05], kr_formula in (0, 1.05], cr in [0, 1];
    for ResidualKV methods |kr_measured - kr_window - kr_formula| <= kr_tol (kr_window: the FP16 recent
    window's bytes beyond coding those tokens, which the seed's formula has no term for; 0 when absent);
    cr >= beta (the full-attention layers' share) for methods that keep those layers (ResidualKV*,
    OmniKV); kr_measured = total_bytes / fp16_bytes and kr_gap_unexplained = 0 (to float rounding)
    where the row carries them; every requested method present.
Benchmark table (one row per method and context length, from the evaluation harness):
    (method, context_len) unique, score and every per-task score in [0, 1], rel_score finite and >= 0
    (absent only when the full cache scores 0 on every task: nothing to be relative to),
    kr_measured in (0, 1.05], cr in [0, 1], ppl and ppl_rel > 0 and finite when present, answer_nll >= 0
    and answer_nll_delta finite when present, score present wherever tasks were scored; every requested
    method present; the full cache's rel_score is 1; rel_score's bootstrap interval, where present, ordered
    and >= 0.

`validate_*` return the validated DataFrame or raise `TableValidationError`, whose message is a
table of the failed checks with the offending methods; the flow stops on it and registers nothing.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterable, Sequence

import pandas as pd

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import pandera.pandas as pa
    from pandera.errors import SchemaError, SchemaErrors

KR_UPPER = 1.05  # a compressed cache may exceed the FP16 baseline only by its bookkeeping on tiny inputs
BYTES_TOL = 1e-9  # KR is a ratio of byte counts: float rounding only
NOT_NAN = ("score", "rel_score", "kr_measured", "cr", "ppl", "ppl_rel", "answer_nll", "answer_nll_delta")
RESIDUAL_PREFIX = "residualkv"


def _finite() -> pa.Check:
    return pa.Check(lambda s: s.map(math.isfinite), name="finite")


class TableValidationError(ValueError):
    """A table failed its schema; str() is a readable report."""

    def __init__(self, table: str, report: str, failures: pd.DataFrame | None = None,
                 consequence: str = "nothing was registered"):
        super().__init__(f"{table} table failed validation - {consequence}.\n{report}")
        self.table = table
        self.report = report
        self.failures = failures


def _is_residual(method: str) -> bool:
    return str(method).startswith(RESIDUAL_PREFIX)


def kr_cr_schema(methods: Sequence[str], beta: float, kr_tol: float, cr_slack: float = 1e-6) -> pa.DataFrameSchema:
    requested = list(methods)

    def kr_matches_formula(df: pd.DataFrame) -> pd.Series:
        window = df["kr_window"].fillna(0.0) if "kr_window" in df else 0.0
        ok = (df["kr_measured"] - window - df["kr_formula"]).abs() <= kr_tol
        return ok | ~df["method"].map(_is_residual)

    def cr_at_least_beta(df: pd.DataFrame) -> pd.Series:
        keeps_full_layers = df["method"].map(lambda m: _is_residual(m) or str(m).startswith("omnikv"))
        return (df["cr"] >= beta - cr_slack) | ~keeps_full_layers

    def no_missing_methods(df: pd.DataFrame) -> bool:
        return set(requested) <= set(df["method"])

    def kr_is_the_bytes(df: pd.DataFrame) -> pd.Series:
        if "total_bytes" not in df or "fp16_bytes" not in df:
            return pd.Series(True, index=df.index)
        both = df["total_bytes"].notna() & df["fp16_bytes"].notna()
        ratio = df["total_bytes"].astype(float) / df["fp16_bytes"].astype(float)
        return ~both | ((df["kr_measured"] - ratio).abs() <= BYTES_TOL)

    def every_byte_explained(df: pd.DataFrame) -> pd.Series:
        if "kr_gap_unexplained" not in df:
            return pd.Series(True, index=df.index)
        gap = df["kr_gap_unexplained"]
        return gap.isna() | (gap.astype(float).abs() <= BYTES_TOL)

    return pa.DataFrameSchema(
        {
            "method": pa.Column(str, pa.Check.isin(requested, error="method not requested")),
            "context_len": pa.Column(int, pa.Check.gt(0), coerce=True),
            "kr_measured": pa.Column(float, pa.Check.in_range(0.0, KR_UPPER, include_min=False), coerce=True),
            "kr_formula": pa.Column(float, pa.Check.in_range(0.0, KR_UPPER, include_min=False), coerce=True),
            "cr": pa.Column(float, pa.Check.in_range(0.0, 1.0 + cr_slack), coerce=True),
            "total_bytes": pa.Column(float, pa.Check.gt(0), coerce=True, required=False, nullable=True),
            "fp16_bytes": pa.Column(float, pa.Check.gt(0), coerce=True, required=False, nullable=True),
        },
        checks=[
            pa.Check(kr_matches_formula,
                     name=f"|kr_measured - kr_window - kr_formula| <= {kr_tol} (ResidualKV methods)"),
            pa.Check(cr_at_least_beta, name=f"cr >= beta = {beta:.4f} (methods that keep the full-attention layers)"),
            pa.Check(kr_is_the_bytes, name="kr_measured == total_bytes / fp16_bytes"),
            pa.Check(every_byte_explained, name=f"|kr_gap_unexplained| <= {BYTES_TOL:g} (every byte accounted for)"),
            pa.Check(no_missing_methods, name=f"every requested method present: {requested}"),
        ],
        unique=["method", "context_len"],
        name="kr_cr",
        strict=False,
    )


def benchmark_schema(methods: Sequence[str], task_columns: Iterable[str] = (), full_method: str = "full",
                     full_tol: float = 1e-6, rel_score_required: bool = True) -> pa.DataFrameSchema:
    requested = list(methods)
    columns: dict[str, pa.Column] = {
        "method": pa.Column(str, pa.Check.isin(requested, error="method not requested")),
        "score": pa.Column(float, pa.Check.in_range(0.0, 1.0), coerce=True, nullable=True),
        "rel_score": pa.Column(float, [pa.Check.ge(0.0), _finite()],
                               coerce=True, nullable=not rel_score_required),
        "kr_measured": pa.Column(float, pa.Check.in_range(0.0, KR_UPPER, include_min=False), coerce=True),
        "cr": pa.Column(float, pa.Check.in_range(0.0, 1.0), coerce=True),
        "ppl": pa.Column(float, [pa.Check.gt(0.0), _finite()],
                         coerce=True, required=False, nullable=True),
        # ppl_rel guards promotion (and is the score of profiles that rank by perplexity)
        "ppl_rel": pa.Column(float, [pa.Check.gt(0.0), _finite()],
                             coerce=True, required=False, nullable=True),
        "answer_nll": pa.Column(float, [pa.Check.ge(0.0), _finite()],
                                coerce=True, required=False, nullable=True),
        "answer_nll_delta": pa.Column(float, _finite(), coerce=True,
                                      required=False, nullable=True),
        "context_len": pa.Column(int, pa.Check.ge(0), coerce=True),
    }
    for col in task_columns:
        columns[col] = pa.Column(float, pa.Check.in_range(0.0, 1.0), coerce=True, nullable=False)

    for col in ("rel_score_ci_lo", "rel_score_ci_hi"):
        columns[col] = pa.Column(float, pa.Check.ge(0.0), coerce=True, required=False, nullable=True)

    def no_missing_methods(df: pd.DataFrame) -> bool:
        return set(requested) <= set(df["method"])

    def ordered_interval(df: pd.DataFrame) -> bool:
        if "rel_score_ci_lo" not in df:
            return True
        both = df["rel_score_ci_lo"].notna() & df["rel_score_ci_hi"].notna()
        return bool((df.loc[both, "rel_score_ci_lo"] <= df.loc[both, "rel_score_ci_hi"]).all())

    def scored_where_tasks_ran(df: pd.DataFrame) -> pd.Series:
        ran = df[list(task_columns)].notna().any(axis=1) if list(task_columns) else pd.Series(False, index=df.index)
        return ~ran | df["score"].notna()

    def full_is_reference(df: pd.DataFrame) -> bool:
        full = df[(df["method"] == full_method) & df["rel_score"].notna()]
        return bool(((full["rel_score"] - 1.0).abs() <= full_tol).all())

    checks = [pa.Check(no_missing_methods, name=f"every requested method present: {requested}"),
              pa.Check(ordered_interval, name="rel_score_ci_lo <= rel_score_ci_hi"),
              pa.Check(scored_where_tasks_ran, name="score present where tasks were scored")]
    if full_method in requested:
        checks.append(pa.Check(full_is_reference, name=f"{full_method}.rel_score == 1 (scores are relative to it)"))
    return pa.DataFrameSchema(columns, checks=checks, name="benchmark", strict=False,
                              unique=["method", "context_len"])


def benchmark_frame(rows: Sequence[dict[str, Any]]) -> tuple[pd.DataFrame, list[str]]:
    """The harness's rows as a flat table: per-task scores become `task_<name>` columns."""
    from residualkv.evaluation.report import scalar_columns

    flat, tasks = [], []
    for row in rows:
        out = scalar_columns(row)
        for name, value in (row.get("tasks") or {}).items():
            out[f"task_{name}"] = value
            if f"task_{name}" not in tasks:
                tasks.append(f"task_{name}")
        flat.append(out)
    df = pd.DataFrame(flat)
    if "context_len" not in df:
        df["context_len"] = 0
    df["context_len"] = df["context_len"].fillna(0)
    return df, tasks


def _report(error: SchemaErrors | SchemaError, df: pd.DataFrame, requested: Sequence[str]) -> tuple[str, pd.DataFrame]:
    cases = getattr(error, "failure_cases", None)
    if cases is None or not isinstance(cases, pd.DataFrame) or cases.empty:
        return str(error), pd.DataFrame()
    rows = []
    for _, case in cases.iterrows():
        idx = case.get("index")
        method = "-"
        if idx is not None and not (isinstance(idx, float) and math.isnan(idx)) and idx in df.index and "method" in df:
            method = str(df.loc[idx, "method"])
        rows.append({"check": str(case.get("check")), "column": str(case.get("column") or "-"),
                     "method": method, "value": str(case.get("failure_case"))})
    table = pd.DataFrame(rows).drop_duplicates()
    # A dataframe-wide check reports every cell of a failing row: fold those into one line per row.
    lines = []
    for (check, method), group in table.groupby(["check", "method"], sort=False):
        if len(group) == 1:
            g = group.iloc[0]
            value = g["value"] if g["column"] in ("-", schema_name(error)) else f"{g['column']}={g['value']}"
        else:
            value = ", ".join(f"{c}={v}" for c, v in zip(group["column"], group["value"]) if c != "method")
        lines.append({"failed check": check, "method": method, "values": value})
    text = pd.DataFrame(lines).to_string(index=False)
    missing = [m for m in requested if m not in set(df.get("method", []))]
    if missing:
        text += f"\nmissing methods: {missing}"
    return text, table


def schema_name(error: SchemaErrors | SchemaError) -> str:
    schema = getattr(error, "schema", None)
    return str(getattr(schema, "name", "") or "")


def _validate(schema: pa.DataFrameSchema, df: pd.DataFrame, table: str, requested: Sequence[str],
              consequence: str = "nothing was registered") -> pd.DataFrame:
    try:
        return schema.validate(df, lazy=True)
    except (SchemaErrors, SchemaError) as error:
        text, cases = _report(error, df, requested)
        raise TableValidationError(table, text, cases, consequence) from None


def validate_kr_cr(rows: Sequence[dict[str, Any]] | pd.DataFrame, *, methods: Sequence[str], beta: float,
                   kr_tol: float) -> pd.DataFrame:
    df = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    if "method" not in df:
        raise TableValidationError("KR/CR", f"no 'method' column; columns are {list(df.columns)}")
    return _validate(kr_cr_schema(methods, beta, kr_tol), df, "KR/CR", methods)


def validate_benchmark(rows: Sequence[dict[str, Any]] | pd.DataFrame, *, methods: Sequence[str],
                       task_columns: Iterable[str] | None = None, table: str = "benchmark",
                       consequence: str = "nothing was registered") -> pd.DataFrame:
    """Validate the benchmark rows. rel_score may be missing only where the full cache scores 0 on every task
    (the harness then has no reference to be relative to, e.g. a tiny random model). `table` and
    `consequence` name the table and what its failure means in the error."""
    if isinstance(rows, pd.DataFrame):
        df, found = rows, [c for c in rows.columns if c.startswith("task_")]
    else:
        # a table reads NaN as "absent" (nullable columns pass it): a NaN the harness computed is refused here
        nan = [(r.get("method"), k) for r in rows for k in NOT_NAN
               if isinstance(r.get(k), float) and math.isnan(r[k])]
        if nan:
            raise TableValidationError(table, "NaN where a number was measured (absent values are None): "
                                       + ", ".join(f"{m}.{k}" for m, k in nan), consequence=consequence)
        df, found = benchmark_frame(rows)
    if "method" not in df:
        raise TableValidationError(table, f"no 'method' column; columns are {list(df.columns)}", consequence=consequence)
    signal = "rel_score" in df and df["rel_score"].notna().any()
    schema = benchmark_schema(methods, found if task_columns is None else task_columns, rel_score_required=bool(signal))
    return _validate(schema, df, table, methods, consequence)


# ---------------------------------------------------------------------------------------------- Prefect tasks

from prefect import task  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402

from .common import say  # noqa: E402


@task(name="validate-kr-cr", cache_policy=NO_CACHE)
def validate_kr_cr_table(kr: dict[str, Any], methods: Sequence[str], kr_tol: float) -> dict[str, Any]:
    df = validate_kr_cr(kr["rows"], methods=methods, beta=kr["beta"], kr_tol=kr_tol)
    say(f"KR/CR table valid: {len(df)} rows, beta={kr['beta']:.3f}, |KR measured - FP16 window - formula| <= {kr_tol}")
    return {"valid": True, "rows": len(df)}


@task(name="validate-benchmark", cache_policy=NO_CACHE)
def validate_benchmark_table(bench: dict[str, Any], methods: Sequence[str]) -> dict[str, Any]:
    df = validate_benchmark(bench["rows"], methods=methods)
    say(f"benchmark table valid: {len(df)} rows for {sorted(set(df['method']))}")
    return {"valid": True, "rows": len(df)}
