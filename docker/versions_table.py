"""Print (or --write) the version table of docker/versions.env as Markdown.

The table goes between `<!-- versions:begin -->` and `<!-- versions:end -->` in docker/README.md (the
repository README links it); tests/docker/test_versions.py parses those tables and fails when they differ from
docker/versions.env.

    python3 docker/versions_table.py            # print the block
    python3 docker/versions_table.py --write    # rewrite the block in docker/README.md
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- versions:begin -->", "<!-- versions:end -->"
READMES = (ROOT / "docker" / "README.md",)

COMPONENTS = {
    "CANN_VERSION": "CANN",
    "PYTHON_VERSION": "Python",
    "BASE_IMAGE_A2": "Base image, A2 (910B)",
    "BASE_IMAGE_A3": "Base image, A3 (910C)",
    "SOC_VERSION_A2": "SOC_VERSION, A2",
    "SOC_VERSION_A3": "SOC_VERSION, A3",
    "TORCH_VERSION": "torch",
    "TORCH_NPU_VERSION": "torch_npu",
    "TORCHVISION_VERSION": "torchvision",
    "TRITON_ASCEND_VERSION": "triton-ascend",
    "VLLM_VERSION": "vLLM (built with VLLM_TARGET_DEVICE=empty)",
    "VLLM_REF": "vLLM git tag",
    "VLLM_ASCEND_BRANCH": "vLLM-Ascend branch",
    "VLLM_ASCEND_COMMIT": "vLLM-Ascend commit (last on CANN 9.0.1)",
    "MEGATRON_CORE_VERSION": "Megatron-Core",
    "MEGATRON_LM_REF": "Megatron-LM git tag",
    "MEGATRON_LM_COMMIT": "Megatron-LM commit",
    "MINDSPEED_VERSION": "MindSpeed",
    "MINDSPEED_REF": "MindSpeed branch",
    "MINDSPEED_COMMIT": "MindSpeed commit",
    "MEGATRON_BRIDGE_VERSION": "Megatron-Bridge",
    "MEGATRON_BRIDGE_REF": "Megatron-Bridge git tag",
    "MEGATRON_BRIDGE_COMMIT": "Megatron-Bridge commit",
}

NOTE = ("Two images, A2 and A3, from `docker/Dockerfile`; this page says how to build, run and verify "
        "them (no image is published yet). **They have not been built or run on Ascend hardware by this project "
        "yet**: the pins below are taken from upstream sources, and `scripts/npu_smoke.py` is the first "
        "thing to run on a node.")


def read_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            pins[key] = value
    return pins


def table(pins: dict[str, str]) -> str:
    unknown = sorted(set(pins) - set(COMPONENTS))
    if unknown:
        raise SystemExit(f"versions_table.py: give {', '.join(unknown)} a component name in COMPONENTS")
    rows = ["| Component | `docker/versions.env` key | Pinned to |", "|---|---|---|"]
    rows += [f"| {COMPONENTS[key]} | `{key}` | `{value}` |" for key, value in pins.items()]
    return "\n".join(rows)


def block(pins: dict[str, str]) -> str:
    return f"{BEGIN}\n{NOTE}\n\n{table(pins)}\n{END}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the block in docker/README.md")
    args = parser.parse_args(argv)
    new = block(read_pins(ROOT / "docker" / "versions.env"))
    if not args.write:
        print(new)
        return 0
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    for readme in READMES:
        text = readme.read_text()
        if not pattern.search(text):
            raise SystemExit(f"versions_table.py: {readme} has no {BEGIN} ... {END} block")
        readme.write_text(pattern.sub(lambda _: new, text, count=1))
        print(f"updated {readme.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
