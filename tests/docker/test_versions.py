"""docker/versions.env is the one source of the image pins: every copy must agree with it.

Each file is parsed on its own terms (env lines, Dockerfile ARGs, TOML, Markdown tables, the build
script's dry-run output) and compared with versions.env. The mutation tests copy the files into a
tmp dir, change one pin in one file, and show that the check catches it.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
FILES = (
    "docker/versions.env",
    "docker/Dockerfile",
    "pyproject.toml",
    "README.md",
    "docker/README.md",
    "scripts/build_images.sh",
)
BEGIN, END = "<!-- versions:begin -->", "<!-- versions:end -->"
HEX40 = re.compile(r"\b[0-9a-f]{40}\b")

# versions.env keys the Dockerfile must declare as ARG (with the same default)
DOCKERFILE_ARGS = (
    "BASE_IMAGE_A2", "BASE_IMAGE_A3", "SOC_VERSION_A2", "SOC_VERSION_A3",
    "TORCH_VERSION", "TORCHVISION_VERSION", "TORCH_NPU_VERSION", "TRITON_ASCEND_VERSION",
    "VLLM_REF", "VLLM_ASCEND_BRANCH", "VLLM_ASCEND_COMMIT",
    "MEGATRON_LM_COMMIT", "MINDSPEED_COMMIT", "MEGATRON_BRIDGE_COMMIT",
)  # fmt: skip


# ------------------------------------------------------------------------------------ parsers


def parse_env(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", key), f"not KEY=VALUE: {line!r}"
        assert value and not re.search(r"[\s\"'$`]", value), f"value must be plain: {line!r}"
        assert key not in pins, f"{key} set twice"
        pins[key] = value
    return pins


def parse_dockerfile_args(text: str) -> dict[str, list[str]]:
    """ARG NAME=default -> every default given to NAME (a name may be declared in several stages)."""
    text = re.sub(r"\\\n", " ", text)
    args: dict[str, list[str]] = {}
    for m in re.finditer(r"^\s*ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?", text, re.M):
        args.setdefault(m.group(1), []).append(m.group(2) or "")
    return args


def parse_requirement(req: str) -> tuple[str, str]:
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*?)\s*(?:;.*)?", req)
    assert m, req
    return re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(2).replace(" ", "")


def parse_version_table(text: str) -> dict[str, str]:
    """The Markdown table between the markers: `KEY` column -> `value` column."""
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "one versions:begin/end block expected"
    block = text[text.index(BEGIN) + len(BEGIN):text.index(END)]
    rows = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) == 3 and re.fullmatch(r"`[A-Z][A-Z0-9_]*`", cells[1]):
            assert cells[2].startswith("`") and cells[2].endswith("`"), line
            assert cells[1][1:-1] not in rows, f"{cells[1]} listed twice"
            rows[cells[1][1:-1]] = cells[2][1:-1]
    return rows


# ------------------------------------------------------------------------------------ the check


def consistency_problems(root: Path) -> list[str]:
    """Every disagreement between versions.env and the files that repeat its pins."""
    problems: list[str] = []
    pins = parse_env((root / "docker/versions.env").read_text())

    # versions.env with itself: refs and base images spelled from the version numbers
    derived = {
        "VLLM_REF": f"v{pins['VLLM_VERSION']}",
        "MEGATRON_LM_REF": f"core_v{pins['MEGATRON_CORE_VERSION']}",
        "MINDSPEED_REF": f"core_r{pins['MINDSPEED_VERSION']}",
        "MEGATRON_BRIDGE_REF": f"v{pins['MEGATRON_BRIDGE_VERSION']}",
        "VLLM_ASCEND_BRANCH": f"releases/v{pins['VLLM_VERSION']}",
        "BASE_IMAGE_A2": f"quay.io/ascend/cann:{pins['CANN_VERSION']}-910b-ubuntu22.04-py{pins['PYTHON_VERSION']}",
        "BASE_IMAGE_A3": f"quay.io/ascend/cann:{pins['CANN_VERSION']}-a3-ubuntu22.04-py{pins['PYTHON_VERSION']}",
    }
    for key, want in derived.items():
        if pins.get(key) != want:
            problems.append(f"docker/versions.env: {key}={pins.get(key)} but the versions imply {want}")

    # Dockerfile: ARG defaults, and no pin spelled out anywhere else
    dockerfile = (root / "docker/Dockerfile").read_text()
    args = parse_dockerfile_args(dockerfile)
    for key in DOCKERFILE_ARGS:
        for default in args.get(key, [None]):
            if default != pins[key]:
                problems.append(f"docker/Dockerfile: ARG {key}={default}, versions.env has {pins[key]}")
    commits = {v for v in pins.values() if HEX40.fullmatch(v)}
    for sha in sorted(set(HEX40.findall(dockerfile)) - commits):
        problems.append(f"docker/Dockerfile: commit {sha} is not in versions.env")
    for image in sorted(set(re.findall(r"quay\.io/ascend/cann:[\w.-]+", dockerfile))):
        if image not in (pins["BASE_IMAGE_A2"], pins["BASE_IMAGE_A3"]):
            problems.append(f"docker/Dockerfile: base image {image} is not in versions.env")
    if "FROM ${BASE_IMAGE_A2}" not in dockerfile or "FROM ${BASE_IMAGE_A3}" not in dockerfile:
        problems.append("docker/Dockerfile: the chip stages must start FROM ${BASE_IMAGE_A2} / ${BASE_IMAGE_A3}")

    # pyproject.toml: the npu and megatron extras
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    npu = dict(parse_requirement(r) for r in extras.get("npu", []))
    want_npu = {"torch": f"=={pins['TORCH_VERSION']}", "torch-npu": f"=={pins['TORCH_NPU_VERSION']}"}
    if npu != want_npu:
        problems.append(f"pyproject.toml: npu extra is {npu}, versions.env implies {want_npu}")
    megatron = dict(parse_requirement(r) for r in extras.get("megatron", []))
    if megatron.get("megatron-core") != f"=={pins['MEGATRON_CORE_VERSION']}":
        problems.append(f"pyproject.toml: megatron extra pins megatron-core{megatron.get('megatron-core')}, "
                        f"versions.env has {pins['MEGATRON_CORE_VERSION']}")

    # the version table in docker/README.md (the repository README links it)
    for readme in ("docker/README.md",):
        try:
            table = parse_version_table((root / readme).read_text())
        except AssertionError as exc:
            problems.append(f"{readme}: {exc}")
            continue
        for key in sorted(set(pins) | set(table)):
            if table.get(key) != pins.get(key):
                problems.append(f"{readme}: version table has {key}={table.get(key)}, "
                                f"versions.env has {pins.get(key)}")

    # the build script: pins only from versions.env, all of the Dockerfile's pins passed through
    script = root / "scripts/build_images.sh"
    for sha in sorted(set(HEX40.findall(script.read_text()))):
        problems.append(f"scripts/build_images.sh: hard-coded commit {sha}")
    out = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        problems.append(f"scripts/build_images.sh --dry-run failed: {out.stderr.strip()}")
        return problems
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    stack = f"cann{pins['CANN_VERSION']}-torch{pins['TORCH_VERSION']}-vllm{pins['VLLM_VERSION']}"
    lines = [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]
    for chip, argv in zip(("a2", "a3"), lines, strict=False):
        pairs = [a.split("=", 1) for flag, a in zip(argv, argv[1:], strict=False) if flag == "--build-arg"]
        build_args = dict(pairs)
        if len(build_args) != len(pairs):
            problems.append(f"scripts/build_images.sh: a --build-arg is given twice for {chip}")
        tags = {t for flag, t in zip(argv, argv[1:], strict=False) if flag == "--tag"}
        for key in DOCKERFILE_ARGS:
            if build_args.get(key) != pins[key]:
                problems.append(f"scripts/build_images.sh: passes {key}={build_args.get(key)}, "
                                f"versions.env has {pins[key]}")
        if build_args.get("CHIP") != chip:
            problems.append(f"scripts/build_images.sh: image {chip} built with CHIP={build_args.get('CHIP')}")
        want_tags = {f"areal-npu:{version}-{chip}", f"areal-npu:{version}-{stack}-{chip}"}
        if tags != want_tags:
            problems.append(f"scripts/build_images.sh: tags {sorted(tags)}, expected {sorted(want_tags)}")
    if len(lines) != 2:
        problems.append(f"scripts/build_images.sh --dry-run printed {len(lines)} commands, expected 2 (a2, a3)")
    return problems


# ------------------------------------------------------------------------------------ tests


def test_repository_pins_agree():
    assert consistency_problems(ROOT) == []


def test_versions_env_has_every_pin_the_issue_names():
    pins = parse_env((ROOT / "docker/versions.env").read_text())
    assert pins["CANN_VERSION"] == "9.0.1"
    assert pins["SOC_VERSION_A2"] == "ascend910b1"
    assert pins["SOC_VERSION_A3"] == "ascend910_9391"
    assert (pins["TORCH_VERSION"], pins["TORCH_NPU_VERSION"]) == ("2.10.0", "2.10.0.post2")
    assert pins["VLLM_REF"] == "v0.23.0"
    assert pins["VLLM_ASCEND_BRANCH"] == "releases/v0.23.0"
    assert (pins["MEGATRON_LM_REF"], pins["MINDSPEED_REF"]) == ("core_v0.16.1", "core_r0.16.0")
    for key in ("VLLM_ASCEND_COMMIT", "MEGATRON_LM_COMMIT", "MINDSPEED_COMMIT", "MEGATRON_BRIDGE_COMMIT"):
        assert HEX40.fullmatch(pins[key]), f"{key} must be a full 40-hex commit"


@pytest.fixture
def repo_copy(tmp_path: Path) -> Path:
    for rel in FILES:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    assert consistency_problems(tmp_path) == [], "an unmodified copy must pass"
    return tmp_path


def _replace(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, count))


MUTATIONS = {
    # file, old, new, the file the problem must name
    "versions.env torch_npu": ("docker/versions.env", "TORCH_NPU_VERSION=2.10.0.post2",
                               "TORCH_NPU_VERSION=2.10.0.post4", "pyproject.toml"),
    "versions.env vllm-ascend commit": ("docker/versions.env", "VLLM_ASCEND_COMMIT=eaefc536",
                                        "VLLM_ASCEND_COMMIT=aaaaaaaa", "docker/Dockerfile"),
    "versions.env CANN only": ("docker/versions.env", "CANN_VERSION=9.0.1", "CANN_VERSION=9.1.0",
                               "docker/versions.env"),
    "Dockerfile ARG default": ("docker/Dockerfile", "ARG MINDSPEED_COMMIT=e4772499",
                               "ARG MINDSPEED_COMMIT=f4772499", "docker/Dockerfile"),
    "Dockerfile SOC version": ("docker/Dockerfile", "ARG SOC_VERSION_A3=ascend910_9391",
                               "ARG SOC_VERSION_A3=ascend910_9392", "docker/Dockerfile"),
    "Dockerfile hard-coded base": ("docker/Dockerfile", "FROM ${BASE_IMAGE_A3} AS base-a3",
                                   "FROM quay.io/ascend/cann:9.1.0-a3-ubuntu22.04-py3.11 AS base-a3",
                                   "docker/Dockerfile"),
    "pyproject npu extra": ("pyproject.toml", '"torch-npu==2.10.0.post2"', '"torch-npu==2.10.0.post4"',
                            "pyproject.toml"),
    "pyproject megatron extra": ("pyproject.toml", '"megatron-core==0.16.1"', '"megatron-core==0.16.0"',
                                 "pyproject.toml"),
    "docker/README torch row": ("docker/README.md", "| `TORCH_VERSION` | `2.10.0` |", "| `TORCH_VERSION` | `2.9.0` |",
                                "docker/README.md"),
    "docker/README table": ("docker/README.md", "| `MEGATRON_BRIDGE_COMMIT` | `9c9dd848",
                            "| `MEGATRON_BRIDGE_COMMIT` | `0c9dd848", "docker/README.md"),
    "build script hard-codes a pin": ("scripts/build_images.sh", 'cmd+=(--tag "${repo}:${version}-${chip}"',
                                      'cmd+=(--build-arg TORCH_VERSION=2.9.0 --tag "${repo}:${version}-${chip}"',
                                      "scripts/build_images.sh"),
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_a_drifted_pin_fails(repo_copy: Path, name: str):
    rel, old, new, blamed = MUTATIONS[name]
    _replace(repo_copy / rel, old, new)
    problems = consistency_problems(repo_copy)
    assert problems, f"{name}: drift not detected"
    assert any(p.startswith(blamed) for p in problems), problems


def test_readme_blocks_say_the_images_are_untested_on_hardware():
    for readme in ("README.md", "docker/README.md"):
        text = " ".join((ROOT / readme).read_text().split())
        assert re.search(r"not been built or run on Ascend hardware by this project", text), readme
