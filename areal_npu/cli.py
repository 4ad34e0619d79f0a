"""areal-npu: doctor | train | report | plan | tasks | bench.

Config errors exit with code 2 and one line naming the key, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

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

    _check_dry_run_flags(args)
    from areal_npu.platform import described_device

    # --device-kind: validate for the described machines (`device: auto` resolves to that kind);
    # --dry-run: a model.path that is not on this machine is accepted (the plan is for other ones)
    if args.dry_run and not args.device_kind:  # the plan is for the recipe's own device kind
        args.device_kind = _recipe_device(args.recipe, args.overrides)
    with contextlib.ExitStack() as scope:
        if args.device_kind:
            scope.enter_context(described_device(args.device_kind))
        if args.dry_run:
            from areal_npu.recipe import planning_only

            scope.enter_context(planning_only())
        cfg = load_config(RLConfig, args.recipe, args.overrides)
    if args.check:
        print(to_yaml(cfg), end="")
        print(f"# OK: {args.recipe} is valid" + (f" (checked for {args.device_kind})" if args.device_kind else ""))
        return 0
    if args.dry_run:  # the placement plan and its estimates, summary first; nothing started or written
        from areal_npu import dry_run

        return dry_run.run(args, cfg)
    if args.launcher == "ray":  # the Ray launcher places every rank and engine; it loads the recipe again
        from areal_npu.launch import ray_launch

        address = ["--address", args.ray_address] if args.ray_address else []
        return ray_launch.main(
            [args.recipe, *args.overrides, *address, *(["--resume"] if args.resume else [])]
        )
    from areal_npu.launch.torchrun import torchrun_command
    from areal_npu.platform import use_device
    from areal_npu.run import run_rl
    from areal_npu.train.dist import shutdown_distributed

    try:  # validated above; the trainer and every engine it starts compute there
        use_device(cfg.device)
    except ValueError as exc:
        raise ConfigError("device", str(exc)) from None
    # several trainer ranks (train.dp_size): this process becomes torchrun, which starts one per rank
    command = torchrun_command(
        cfg, ["train", args.recipe, *args.overrides, *(["--resume"] if args.resume else [])]
    )
    if command is not None:
        import os

        sys.stdout.flush()
        os.execv(command[0], command)

    try:
        summary = run_rl(cfg, resume=args.resume)
    finally:  # every rank, also on error: an abandoned gloo group can abort the process at exit
        shutdown_distributed()
    print(json.dumps(summary))
    return 0


#: ``train`` flags that describe the --dry-run plan; without --dry-run they would be ignored
DRY_RUN_FLAGS = ("json", "verbose", "nodes", "devices_per_node", "device_kind", "model_config", "master_addr")


def _recipe_device(recipe: str, overrides: list[str]) -> str | None:
    """The recipe's ``device`` when it names a kind (npu / cuda / cpu), else None (``auto``, unreadable:
    validation reports those)."""
    from omegaconf import OmegaConf

    try:
        raw = OmegaConf.merge(OmegaConf.load(recipe), OmegaConf.from_dotlist(list(overrides)))
        device = OmegaConf.select(raw, "device", default=None)
    except Exception:  # noqa: BLE001 - load_config gives the proper error right after
        return None
    return device if device in ("npu", "cuda", "cpu") else None


def _check_dry_run_flags(args: argparse.Namespace) -> None:
    if args.ray_address and args.launcher != "ray":
        raise ConfigError("--ray-address", "names the Ray cluster of --launcher ray; add --launcher ray")
    if args.launcher == "ray" and args.check:
        raise ConfigError("--launcher", "--check only validates the recipe; drop --launcher ray")
    given = [f"--{f.replace('_', '-')}" for f in DRY_RUN_FLAGS if getattr(args, f) not in (None, False)]
    if given and not args.dry_run:
        raise ConfigError(given[0], "describes the plan that --dry-run prints; add --dry-run")
    if args.dry_run and (args.check or args.resume):
        raise ConfigError("--dry-run", f"cannot be combined with {'--check' if args.check else '--resume'}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}")
    return value


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``scripts/bench_<name>.py`` of the source checkout this package is imported from.

    The benchmarks are scripts, not part of the installed package (what they import -- the test
    oracles and models of :mod:`areal_npu.testing` -- is): from an installed copy there is nothing
    to run, and the error says where it looked.
    """
    import subprocess
    from pathlib import Path

    package = Path(__file__).resolve().parent
    scripts = package.parent / "scripts"
    available = sorted(p.stem[len("bench_") :] for p in scripts.glob("bench_*.py"))
    if not available:
        print(
            f"areal-npu bench: no scripts/bench_*.py at {scripts}: the benchmarks run from a source "
            f"checkout of areal-npu (this areal_npu is imported from {package}); install the checkout "
            "with `pip install -e .` and run `areal-npu bench` from its environment",
            file=sys.stderr,
        )
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
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.optim.lr=1e-5")
    p.add_argument("--check", action="store_true", help="validate the recipe, print it resolved, and exit")
    p.add_argument("--resume", action="store_true", help="continue from the run directory's last checkpoint")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, print a summary (placement, the trainer's memory per device with its reserve, a "
        "step-time prediction), one row per role, and exit without starting anything; exit 2 when the memory "
        "is above train.max_memory_fraction of the device",
    )
    p.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="with --dry-run: also every process's environment, the memory terms, the k sweep and Ray's groups",
    )
    p.add_argument("--nodes", type=_positive_int, help="with --dry-run: plan for this many nodes (default 1)")
    p.add_argument(
        "--devices-per-node",
        type=_positive_int,
        help="with --dry-run: devices per node (A2: 8 NPUs, A3: 16 dies; CPU: cores); default: this machine's",
    )
    p.add_argument(
        "--device-kind",
        choices=("npu", "cuda", "cpu"),
        help="with --dry-run: the nodes' devices; default: the recipe's device",
    )
    p.add_argument(
        "--model-config",
        metavar="CONFIG_JSON",
        help="with --dry-run: the model's config.json for the memory estimate (model.path's when omitted); "
        "lets the plan run where the checkpoint is not",
    )
    p.add_argument(
        "--master-addr",
        metavar="ADDR",
        help="with --dry-run: node 0's address (the Ray head, the trainer's rendezvous across nodes); the "
        "other nodes' are taken from Ray at launch",
    )
    p.add_argument(
        "--launcher",
        choices=("local", "ray"),
        default="local",
        help="local (default): this machine, torchrun when train.dp_size > 1; ray: place every trainer rank "
        "and engine on a Ray cluster (python -m areal_npu.launch.ray_launch); with --dry-run: also print "
        "the Ray placement groups",
    )
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --launcher ray: the Ray cluster to join (default: RAY_ADDRESS, else 'auto')",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("report", help="plots and a markdown summary of a run directory")
    from areal_npu import report

    report.add_arguments(p)
    p.set_defaults(func=report.run)

    from areal_npu import plan

    p = sub.add_parser("plan", help="step-time model and draft-length recommendation")
    plan.add_arguments(p)
    p.set_defaults(func=plan.run)

    from areal_npu import tasks_cli

    p = sub.add_parser("tasks", help="task sets: `tasks validate PATH` checks gold / empty / tampered patches")
    tasks_cli.add_arguments(p)

    p = sub.add_parser("bench", help="run one of scripts/bench_*.py (from a source checkout)")
    names = sorted(p.stem[len("bench_") :] for p in (Path(__file__).resolve().parent.parent / "scripts").glob("bench_*.py"))
    p.add_argument("name", nargs="?", help=f"{' | '.join(names) or 'a scripts/bench_*.py name'}; none: list them")
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
