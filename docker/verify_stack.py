"""Check, inside a built image, that what got installed is what docker/versions.env pins.

Run as the last build step of docker/Dockerfile (a drifted pin fails the build) and writes a
manifest of what the image holds (distribution versions, source commits) for `docker inspect`-free
auditing:

    python3 verify_stack.py /opt/areal-npu-stack/versions.env --write-manifest manifest.json

Standard library only. Nothing here imports torch, torch_npu or vLLM: the build host has no NPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

# distribution name -> versions.env key; "public" compares the version without its local part
# (torch 2.10.0+cpu, vllm 0.23.0+empty).
DISTRIBUTIONS = {
    "torch": ("TORCH_VERSION", "public"),
    "torchvision": ("TORCHVISION_VERSION", "public"),
    "torch-npu": ("TORCH_NPU_VERSION", "exact"),
    "triton-ascend": ("TRITON_ASCEND_VERSION", "exact"),
    "vllm": ("VLLM_VERSION", "public"),
    "megatron-core": ("MEGATRON_CORE_VERSION", "exact"),
    "mindspeed": ("MINDSPEED_VERSION", "exact"),
    "megatron-bridge": ("MEGATRON_BRIDGE_VERSION", "exact"),
}
# source checkout -> versions.env key of the commit it must be at
CHECKOUTS = {
    "/opt/vllm-ascend": "VLLM_ASCEND_COMMIT",
    "/opt/Megatron-LM": "MEGATRON_LM_COMMIT",
    "/opt/MindSpeed": "MINDSPEED_COMMIT",
    "/opt/Megatron-Bridge": "MEGATRON_BRIDGE_COMMIT",
}
# recorded, not pinned by commit (vLLM is pinned by its release tag)
RECORDED = ("/opt/vllm",)
UNPINNED_DISTRIBUTIONS = ("vllm-ascend", "transformers", "areal-npu")


def read_versions_env(path: str | Path) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and # comments ignored; no quoting or expansion."""
    pins = {}
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier() or not value or any(c in value for c in " \t\"'$`"):
            raise ValueError(f"{path}:{lineno}: expected KEY=VALUE without quotes or spaces: {line!r}")
        pins[key] = value
    return pins


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_head(path: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def check(
    pins: dict[str, str],
    version_of: Callable[[str], str | None] = installed_version,
    head_of: Callable[[str], str | None] = git_head,
    env: dict[str, str] | None = None,
) -> tuple[dict, list[str]]:
    """Compare the installed stack with the pins; return (manifest, problems)."""
    env = dict(os.environ) if env is None else env
    problems: list[str] = []
    manifest: dict = {"distributions": {}, "checkouts": {}, "chip": env.get("AREAL_NPU_CHIP")}
    for dist, (key, how) in DISTRIBUTIONS.items():
        got, want = version_of(dist), pins[key]
        manifest["distributions"][dist] = got
        seen = got.split("+", 1)[0] if (got and how == "public") else got
        if seen != want:
            problems.append(f"{dist}: installed {got}, {key} pins {want}")
    for dist in UNPINNED_DISTRIBUTIONS:
        manifest["distributions"][dist] = version_of(dist)
    for path, key in CHECKOUTS.items():
        got = head_of(path)
        manifest["checkouts"][path] = got
        if got != pins[key]:
            problems.append(f"{path}: at commit {got}, {key} pins {pins[key]}")
    for path in RECORDED:
        manifest["checkouts"][path] = head_of(path)
    chip = env.get("AREAL_NPU_CHIP", "")
    soc_key = f"SOC_VERSION_{chip.upper()}"
    if soc_key not in pins:
        problems.append(f"AREAL_NPU_CHIP={chip!r} is not a chip versions.env knows (a2, a3)")
    elif env.get("SOC_VERSION") != pins[soc_key]:
        problems.append(f"SOC_VERSION={env.get('SOC_VERSION')}, {soc_key} pins {pins[soc_key]}")
    manifest["soc_version"] = env.get("SOC_VERSION")
    manifest["pins"] = pins
    return manifest, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("versions_env")
    parser.add_argument("--write-manifest", metavar="PATH")
    args = parser.parse_args(argv)
    manifest, problems = check(read_versions_env(args.versions_env))
    if args.write_manifest:
        Path(args.write_manifest).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    for problem in problems:
        print(f"verify_stack: {problem}", file=sys.stderr)
    if problems:
        return 1
    print("verify_stack: the installed stack matches", args.versions_env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
