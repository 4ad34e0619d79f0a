"""The images' extras cover what the 64K recipes call (docker/image_extras.py): the real Dockerfile
passes, and a Dockerfile or recipe that drifts is named. Standard library only, like the image job."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("image_extras", ROOT / "docker" / "image_extras.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()


def test_the_images_install_every_extra_the_recipes_call():
    extras, dropped = mod.image_extras(DOCKERFILE)
    assert {"npu", "megatron", "ray", "agent"} <= set(extras) and dropped == ["triton"]
    # what the recipes call, found independently of the patterns: the script's default launcher is
    # Ray, the YAMLs train with Megatron on the NPU with mini-swe-agent on repo tasks
    launch = (ROOT / "recipes/code_agent_64k/_launch.sh").read_text()
    assert (
        "LAUNCHER=${LAUNCHER:-ray}" in launch
        and "RAY=${RAY:-ray}" in launch
        and '"$RAY" start --head' in launch
    )
    for yaml in (ROOT / "recipes/code_agent_64k").glob("*.yaml"):
        text = yaml.read_text()
        assert "backend: megatron" in text and "device: npu" in text and "mini_swe_agent" in text
    assert set(mod.recipe_needs()) == {"npu", "megatron", "ray", "agent"}
    assert mod.missing() == []
    out = subprocess.run([sys.executable, str(ROOT / "docker/image_extras.py")], capture_output=True, text=True,
                         timeout=30)  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


def test_a_dropped_extra_is_named_with_the_recipe_that_needs_it():
    for extra in ("ray", "agent", "megatron", "npu"):
        base = "pyproject.toml npu megatron ray agent"
        drifted = DOCKERFILE.replace(base, base.replace(f" {extra}", ""), 1)
        assert drifted != DOCKERFILE
        problems = mod.missing(dockerfile=drifted)
        assert len(problems) == 1 and f"'{extra}'" in problems[0], problems
    assert any(
        "LAUNCHER=ray" in p for p in mod.missing(dockerfile=DOCKERFILE.replace(" ray agent", " agent", 1))
    )


def test_a_recipe_calling_an_extra_the_image_lacks_fails_the_command(tmp_path):
    for part in ("docker", "recipes/code_agent_64k"):
        shutil.copytree(ROOT / part, tmp_path / part)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    dockerfile = tmp_path / "docker/Dockerfile"
    dockerfile.write_text(DOCKERFILE.replace(" ray agent", "", 1))
    out = subprocess.run([sys.executable, str(tmp_path / "docker/image_extras.py"), "--root", str(tmp_path)],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 1
    assert "'ray'" in out.stderr and "'agent'" in out.stderr and "mini_swe_agent" in out.stderr
