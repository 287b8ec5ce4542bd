"""`rkv registry`: what the codec registry holds, and moving an alias by hand (a rollback).

    rkv registry list [NAME]                   the registered codec models, or one model's versions
    rkv registry show models:/NAME@ALIAS       one version: aliases, complete, tags (JSON)
    rkv registry alias NAME ALIAS VERSION      point ALIAS (champion, candidate) at VERSION, after
                                               downloading it afresh and checking its sha256 as serving does

The store is $MLFLOW_TRACKING_URI (else the embedded one under the data directory), or --tracking-uri.
MLflow is imported when a command runs, not when `rkv` builds its parser.
"""

from __future__ import annotations

import json
import time


def register(subparsers) -> None:
    r = subparsers.add_parser("registry", help="list registered codec versions, show one, or move an alias (rollback)")
    r.add_argument("--tracking-uri", default=None, help="MLflow store to read (default: $MLFLOW_TRACKING_URI, else "
                                                        "the embedded store under the data directory)")
    verbs = r.add_subparsers(dest="verb", required=True)
    li = verbs.add_parser("list", help="registered models, or the versions of one")
    li.add_argument("name", nargs="?", default=None, help="a registered model, e.g. rkv-smollm2-135m")
    sh = verbs.add_parser("show", help="one version as JSON")
    sh.add_argument("uri", help="models:/NAME@ALIAS or models:/NAME/VERSION")
    al = verbs.add_parser("alias", help="point an alias at a version (after verifying its artifacts)")
    al.add_argument("name")
    al.add_argument("alias", help="e.g. champion (what serving loads) or candidate")
    al.add_argument("version")
    r.set_defaults(func=cmd_registry)


def cmd_registry(args) -> int:
    from . import env

    if args.tracking_uri:
        env.use_tracking_uri(args.tracking_uri)
    return {"list": _list, "show": _show, "alias": _alias}[args.verb](args)


def _list(args) -> int:
    from .codecs import is_complete, list_versions, version_metrics
    from .store import client, retrying

    if args.name is None:
        models = retrying(client().search_registered_models, max_results=1000)
        if not models:
            print("no registered codec models")
        for m in sorted(models, key=lambda m: m.name):
            aliases = ", ".join(f"@{a}=v{v}" for a, v in sorted((m.aliases or {}).items())) or "no aliases"
            print(f"{m.name}  ({aliases})")
        return 0
    from .codecs import _describe_model

    versions = list_versions(args.name)
    if not versions:
        from .codecs import RegistryError

        raise RegistryError(f"no versions of {args.name!r} ({_describe_model(args.name)})")
    # a version search leaves aliases out: the model holds them
    by_version: dict[str, list[str]] = {}
    for alias, version in (retrying(client().get_registered_model, args.name).aliases or {}).items():
        by_version.setdefault(str(version), []).append(alias)
    print(f"{'version':>7}  {'aliases':20}  {'complete':8}  {'rel_score':>9}  {'kr_measured':>11}  registered")
    for mv in versions:
        metrics = version_metrics(mv)
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(mv.creation_timestamp / 1000))
        aliases = ",".join(sorted(by_version.get(str(mv.version), []))) or "-"
        print(f"{mv.version:>7}  {aliases:20}  {'yes' if is_complete(mv) else 'NO':8}  "
              f"{_num(metrics.get('rel_score')):>9}  {_num(metrics.get('kr_measured')):>11}  {when} UTC")
    return 0


def _num(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _show(args) -> int:
    from .serving import describe

    print(json.dumps(describe(args.uri), indent=2, sort_keys=True))
    return 0


def _alias(args) -> int:
    from .codecs import _alias as current_alias
    from .serving import load_codec
    from .store import client, retrying, store_lock

    # refuses an incomplete version, or one whose stored artifacts (not a local cached copy: other machines
    # download them) do not hash to its registration, as serving would
    load_codec(f"models:/{args.name}/{args.version}", use_cache=False)
    c = client()
    with store_lock("aliases"):  # the lock promotion takes: no flow moves it between our read and write
        before = current_alias(c, args.name, args.alias)
        retrying(c.set_registered_model_alias, args.name, args.alias, str(args.version))
        retrying(c.set_model_version_tag, args.name, str(args.version), f"rkv.{args.alias}_set_by_hand",
                 time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    was = f"v{before.version}" if before is not None else "unset"
    print(f"{args.name}@{args.alias}: {was} -> v{args.version}")
    return 0
