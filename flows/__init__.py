"""Prefect flows: read top to bottom like the DAG.

    flows.retrain.retrain_flow(profile)   pack -> train (mapped over backbones) -> KR/CR -> validate ->
                                          evaluate -> validate -> throughput -> MLflow -> register -> promote
    flows.bench_regress.bench_regress     re-evaluate and re-time a registered version, compare with its stored metrics
    flows.deploy                          the scheduled retraining deployment (cron from the profile)
    flows.cli                             `rkv run`, `rkv bench-regress`, `rkv deploy`
"""

from registry import env as _env

_env.configure()
