"""Pipeline commands for `rkv` (registered by residualkv/cli.py), also runnable as `python -m flows.cli ...`.

    rkv run [--profile quick]                         the whole pipeline; ends with a summary table
    rkv bench-regress [--codec models:/NAME@champion] [--tolerance 0.02] [--nll-tolerance 0.05] [--flips 1]
                      [--speed-tolerance 0.4 | --no-speed] [--against auto|self|champion]
    rkv deploy [--profile quick] [--run-now] [--run-once] [--work-pool NAME]   scheduled retraining
"""

from __future__ import annotations

import argparse
import sys

from residualkv.config import InputError


def register(subparsers) -> None:
    r = subparsers.add_parser("run", help="the whole pipeline: train, validate, benchmark, register (Prefect + MLflow)")
    r.add_argument("--profile", default="quick", help="configs/pipelines/<profile>.yaml, or a path to one")
    r.add_argument("--json", default=None, metavar="OUT", help="also write the run summary as JSON")
    r.set_defaults(func=cmd_run)

    b = subparsers.add_parser("bench-regress", help="re-evaluate a registered codec version; non-zero on regressions")
    b.add_argument("--codec", default=None, help="models:/NAME@ALIAS or models:/NAME/VERSION "
                                                 "(default: the champion of the profile's first backbone)")
    b.add_argument("--profile", default="quick", help="its registry.tracking_uri (if set) is the store read, and it names the default "
                                                 "model (rkv-<backbone>) when --codec is not given")
    b.add_argument("--tolerance", type=_tolerance, default=0.02,
                   help="allowed worsening: absolute for scores and KR, relative for perplexities (default 0.02)")
    b.add_argument("--nll-tolerance", type=_tolerance, default=None,
                   help="against another version: the answer NLL (nats/token) may rise by this much on the same "
                        "samples before an interval wholly above it is a regression (default 0.05)")
    b.add_argument("--flips", type=_tolerance, default=None,
                   help="against its own stored run: answers the re-run may lose, net of those it gains, per context "
                        "length before its scores count as regressed (another CPU's rounding can flip one; default 1)")
    b.add_argument("--speed-tolerance", type=_tolerance, default=None,
                   help="the decode speed-up over the full cache (timed side by side) may fall by this fraction of "
                        "the baseline's before it is a regression (default 0.4)")
    b.add_argument("--no-speed", action="store_true",
                   help="do not re-time decoding (a busy machine): the speed-up is shown, not gated")
    b.add_argument("--against", default="auto", choices=("auto", "self", "champion"),
                   help="baseline: auto = the version's own metrics if it is the champion, else the champion's")
    b.add_argument("--json", default=None, metavar="OUT", help="also write the comparison as JSON")
    b.set_defaults(func=cmd_bench_regress)

    d = subparsers.add_parser("deploy", aliases=["serve-schedule"],
                              help="scheduled retraining: Prefect deployment with the profile's cron schedule")
    d.add_argument("--profile", default="quick")
    d.add_argument("--run-now", action="store_true", help="also trigger one run immediately")
    d.add_argument("--run-once", action="store_true", help="execute due runs once, wait for them, exit")
    d.add_argument("--timeout", type=float, default=3600.0,
                   help="--run-once: seconds to wait for a due run to start; one that started is waited for to its "
                        "end, however long (Prefect's runner holds it; the default profile takes ~5 h)")
    d.add_argument("--work-pool", default=None, help="register on this work pool for `prefect worker` instead of serving")
    d.add_argument("--port", type=int, default=None, help="port of the local Prefect server started when "
                                                           "PREFECT_API_URL is not set (default: a free one)")
    d.set_defaults(func=cmd_deploy)


def cmd_run(args) -> int:
    import json

    from .profiles import load_profile
    from .retrain import run_profile

    load_profile(args.profile)  # a bad profile fails here, before Prefect starts its temporary server
    code, summary = run_profile(args.profile)
    if args.json and summary is not None:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return code


def _tolerance(text: str) -> float:
    """argparse type: a tolerance is a finite number >= 0 (a negative one would flag every metric: exit 2, not 1)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"needs a finite number >= 0, got {text}")
    return value


def default_uri(prof) -> str:
    """The champion of `prof`'s first backbone (a loaded flows.profiles.Profile)."""
    from tasks.backbones import backbone_name

    name = prof.registry["model_name"].format(backbone=backbone_name(prof.backbones[0]))
    return f"models:/{name}@champion"


def cmd_bench_regress(args) -> int:
    import json

    import registry

    from tasks.validation import TableValidationError

    from .bench_regress import bench_regress
    from .profiles import load_profile

    prof = load_profile(args.profile)
    if prof.registry.get("tracking_uri"):  # the store `rkv run --profile` of this profile registers into
        registry.env.use_tracking_uri(prof.registry["tracking_uri"])
    uri = args.codec or default_uri(prof)
    try:
        extra = {} if args.nll_tolerance is None else {"nll_tolerance": args.nll_tolerance}
        if args.flips is not None:
            extra["allowed"] = args.flips
        if args.speed_tolerance is not None:
            extra["speed_tolerance"] = args.speed_tolerance
        extra["speed"] = not args.no_speed
        report = bench_regress(uri, tolerance=args.tolerance, against=args.against, **extra)
    except registry.RegistryError as error:
        print(f"bench-regress: cannot check {uri}: {error}", file=sys.stderr)
        return 2
    except TableValidationError as error:  # the code ran and measured something invalid: a failure, as in `rkv run`
        print(f"bench-regress: {uri}: {error}", file=sys.stderr)
        return 1
    print(report.text())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"uri": uri, "version": report.version, "passed": report.passed,
                       "baseline": report.baseline_source, "measured": report.measured,
                       "comparisons": [{"metric": c.metric, "baseline": c.baseline, "measured": c.measured,
                                        "allowed": c.allowed, "regressed": c.regressed, "gated": c.gated}
                                       for c in report.comparisons],
                       "paired": [p.as_dict() for p in report.paired], "paired_note": report.paired_note,
                       "flips": [f.as_dict() for f in report.flips], "speed_note": report.speed_note,
                       "speed_rows": report.speed_rows},
                      f, indent=2)
    return 0 if report.passed else 1


def cmd_deploy(args) -> int:
    from .deploy import deploy_command
    from .profiles import load_profile

    load_profile(args.profile)  # a bad profile fails here, before a Prefect server is started for it

    return deploy_command(args.profile, run_now=args.run_now, run_once=args.run_once, timeout=args.timeout,
                          work_pool=args.work_pool, port=args.port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.cli", description=__doc__.split("\n\n")[0])
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except InputError as error:  # as `rkv` does: the message names the input and the fix
        print(f"{args.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
