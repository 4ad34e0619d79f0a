"""Packaging: every package directory is installed, and kernels/ installs as areal_npu.kernels."""

import importlib
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_dir_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        "areal_npu." + ".".join(p.parent.relative_to(ROOT / "areal_npu").parts)
        for p in (ROOT / "areal_npu").rglob("__init__.py")
    }
    found = {name.rstrip(".") for name in found} | {"areal_npu.kernels"}
    found = {n for n in found if "__pycache__" not in n}
    assert found == listed


def test_kernels_is_not_a_top_level_package():
    module = importlib.import_module("areal_npu.kernels")
    assert Path(module.__file__).parent == ROOT / "kernels"
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin or "").parent != ROOT / "kernels"


def test_importing_areal_npu_does_not_touch_npu_packages():
    import subprocess
    import sys

    code = (
        "import sys, areal_npu, areal_npu.platform, areal_npu.config, areal_npu.cli, areal_npu.doctor\n"
        "areal_npu.platform.current_platform()\n"
        "print(sorted(m for m in ('torch_npu', 'mindspeed', 'vllm_ascend') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
