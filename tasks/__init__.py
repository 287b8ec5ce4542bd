"""Prefect tasks: thin, pure functions of their inputs over the `residualkv` library.

    prepare_backbone -> pack_data -> train_codec -> kr_cr_table -> validate_kr_cr
        -> evaluate_codec -> validate_benchmark -> profile_throughput
        -> start_run / log_results -> register_codec_version -> promote_version

Each task is a Prefect task (call `.fn(...)` to run one without Prefect). Expensive ones keep their
outputs in content-addressed folders (`tasks.cache`): a re-run with the same inputs returns the stored
result, and an interrupted training run resumes from its last checkpoint.
The services (MLflow store, Prefect home, telemetry off) are configured once, in `registry.env`.
"""

from registry import env as _env

_env.configure()
