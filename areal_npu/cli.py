"""``areal-npu``: doctor | train | report | plan | bench.

Config errors exit with code 2 and one line naming the key, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from areal_npu.config import ConfigError

EXIT_CONFIG = 2
EXIT_NOT_AVAILABLE = 3


def cmd_doctor(args: argparse.Namespace) -> int:
    from areal_npu import doctor

    report = doctor.collect()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        doctor.render(report)
    return 1 if (args.strict and report["problems"]) else 0


def cmd_train(args: argparse.Namespace) -> int:
    from areal_npu.config import load_config, to_yaml
    from areal_npu.recipe import RLConfig

    cfg = load_config(RLConfig, args.recipe, args.overrides)
    if args.check:
        print(to_yaml(cfg), end="")
        return 0
    from areal_npu.platform import use_device
    from areal_npu.run import run_rl

    try:  # validated above; the trainer and every engine it starts compute there
        use_device(cfg.device)
    except ValueError as exc:
        raise ConfigError("device", str(exc)) from None

    summary = run_rl(cfg, resume=args.resume)
    print(json.dumps(summary))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import subprocess
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    available = sorted(p.stem[len("bench_"):] for p in scripts.glob("bench_*.py"))
    if not available:
        print("areal-npu bench: scripts/ not found (benchmarks run from a source checkout)", file=sys.stderr)
        return EXIT_NOT_AVAILABLE
    if not args.name:
        print("benchmarks: " + ", ".join(available))
        return 0
    if args.name not in available:
        raise ConfigError("name", f"unknown benchmark {args.name!r}; available: {', '.join(available)}")
    return subprocess.call([sys.executable, str(scripts / f"bench_{args.name}.py"), *args.args])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="areal-npu", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("doctor", help="device, versions, environment and the path each component takes")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 when a problem is found")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("train", help="run a recipe: asynchronous GRPO with MTP speculative rollouts")
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/cpu/quickstart.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5")
    p.add_argument("--check", action="store_true", help="validate the recipe, print it resolved, and exit")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("report", help="plots and a markdown summary of a run directory")
    from areal_npu import report

    report.add_arguments(p)
    p.set_defaults(func=report.run)

    from areal_npu import plan_cli

    p = sub.add_parser("plan", help="step-time model and draft-length recommendation")
    plan_cli.add_arguments(p)
    p.set_defaults(func=plan_cli.run)

    p = sub.add_parser("bench", help="run one of scripts/bench_*.py (from a source checkout)")
    p.add_argument("name", nargs="?", help="packing | logprobs | mtp | rollout; none: list them")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed on, e.g. --quick --json out.json")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `train RECIPE --resume a.b=1`: argparse stops filling `overrides` at the flag; take the rest.
    if getattr(args, "command", None) == "train" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
