"""Builds a SWE-bench-format task set from a pinned description of real libraries (SWE-smith's method).

    python scripts/make_swe_tasks.py [--spec recipes/tasks/pylibs.yaml] [--library NAME ...]
        [--max-per-lib N] [--out DIR] [--image-root DIR | --rootfs DIR | --host] [--json PATH] [--force]

Without --out the set goes to (and is reused from) $AREAL_NPU_CACHE/tasksets/<name>-<hash>/. The
suites run where the tasks are graded: in the jail on the spec's image, an OCI layout built from
Debian's packages (areal_npu.agent.debian_image) under --image-root (default
$AREAL_NPU_CACHE/images) and reused from there; --rootfs names a root filesystem instead, --host
uses this machine's interpreter. Prints the set's path, a table per library and the settings that
train or validate on it; --json writes the same.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from areal_npu.agent.taskgen.build import build_taskset
from areal_npu.agent.taskgen.spec import load_spec, select


def spec_image_rootfs(image: str, image_root: Path) -> Path:
    """The spec's image, built from Debian's packages at ``image_root/image`` (or reused), unpacked."""
    from areal_npu.agent import debian_image, rootfs

    layout = image_root / image
    debian_image.build_python_image(layout)
    return rootfs.unpack(layout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=Path("recipes/tasks/pylibs.yaml"))
    parser.add_argument("--out", type=Path, help="the set's folder (default: the cache)")
    parser.add_argument("--max-per-lib", type=int, help="tasks per library at most (default: the spec's)")
    parser.add_argument("--json", type=Path, help="write the per-library report here")
    parser.add_argument("--library", action="append", help="only this library of the spec (repeat)")
    parser.add_argument("--image-root", type=Path, help="where the spec's image is built / found "
                        "(default $AREAL_NPU_CACHE/images)")  # fmt: skip
    parser.add_argument("--rootfs", type=Path, help="run the suites in the jail on this root filesystem")
    parser.add_argument("--host", action="store_true", help="run the suites on this machine's interpreter")
    parser.add_argument("--workers", type=int, help="suites run at once (default: min(4, cores))")
    parser.add_argument("--force", action="store_true", help="rebuild even when the set is cached")
    parser.add_argument(
        "--no-check", action="store_true", help="skip grading each row's gold and empty patch"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.max_per_lib is not None and args.max_per_lib < 1:
        parser.error("--max-per-lib must be >= 1")
    if args.host and args.rootfs:
        parser.error("--host and --rootfs exclude each other")
    spec = load_spec(args.spec)
    if args.library:
        spec = select(spec, args.library)
    from areal_npu.agent.rootfs import cache_root

    image_root = (args.image_root or cache_root() / "images").absolute()
    rootfs = args.rootfs
    if rootfs is None and not args.host:
        rootfs = spec_image_rootfs(spec.image, image_root)
    result = build_taskset(spec, out=args.out, rootfs=rootfs, force=args.force, max_per_lib=args.max_per_lib,
                           workers=args.workers, progress=not args.quiet, check=not args.no_check)  # fmt: skip
    print(f"{result.path / 'tasks.jsonl'} ({'reused' if result.reused else 'built'})")
    head = (
        f"{'library':<22} {'tests':>5} {'suite s':>7} {'tried':>5} {'kept':>4} {'F2P/task':>8} {'time s':>7}"
    )
    print(head)
    for r in result.reports:
        print(f"{r.library:<22} {r.tests:>5} {r.suite_s:>7.2f} {r.tried:>5} {r.kept:>4} {r.fail_to_pass_mean:>8.1f} "
              f"{r.seconds:>7.1f}")  # fmt: skip
    print(f"{'total':<22} {'':>5} {'':>7} {sum(r.tried for r in result.reports):>5} "
          f"{sum(r.kept for r in result.reports):>4}")  # fmt: skip
    tasks = result.path / "tasks.jsonl"
    if not args.host and not args.rootfs:
        print(f"validate: areal-npu tasks validate {tasks} --backend bwrap --image-root {image_root}")
        print(f"train:    task.kind=repo task.dataset={tasks} task.image_root={image_root}")
    if args.json:
        report = {
            "path": str(result.path),
            "image_root": str(image_root),
            "reused": result.reused,
            "libraries": [asdict(r) for r in result.reports],
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
