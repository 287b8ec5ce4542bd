"""MLflow model-registry helpers for ResidualKV codecs, and the serving loader.

    from registry import register_codec, promote_if_not_worse, load_codec

The library (`residualkv`) never imports this package; `rkv ... --codec models:/...` does, lazily.
Configuration (tracking URI, artifact folder, telemetry) lives in `registry.env`.
"""

from . import env

env.configure()

# MLflow is imported on first use of a name below, not with the package: `flows/` and `tasks/` import
# `registry.env` at start-up (the `rkv` parser among them) and should not pay for MLflow there.
_LAZY = {
    **{name: "codecs" for name in (
        "CANDIDATE", "CHAMPION", "COMPLETE_TAG", "PromotionDecision", "PromotionRule", "RegisteredCodec",
        "RegistryError", "default_model_name", "get_version", "is_complete", "list_versions",
        "promote_if_not_worse", "register_codec", "version_metrics", "version_speed_suite", "version_suite")},
    "fetch_codec_dir": "serving",
    "load_codec": "serving",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'registry' has no attribute {name!r}")


__all__ = [*_LAZY, "env"]
