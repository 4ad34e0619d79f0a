"""What the image definition must contain, read from docker/Dockerfile; and its helper scripts."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
INSTRUCTIONS = re.sub(r"\\\n", " ", DOCKERFILE)


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docker" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env_values() -> dict[str, str]:
    env = {}
    for line in INSTRUCTIONS.splitlines():
        if line.startswith("ENV "):
            env.update(re.findall(r"([A-Z_][A-Z0-9_]*)=(\S+)", line))
    return env


def test_runtime_environment():
    env = env_values()
    assert env["TASK_QUEUE_ENABLE"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert env["VLLM_ASCEND_ENABLE_NZ"] == "0"
    for name in ("HCCL_IF_BASE_PORT", "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT"):
        assert env[name].isdigit(), name
    assert env["SOC_VERSION"] in ("${SOC_VERSION_A2}", "${SOC_VERSION_A3}")
    assert env["BASH_ENV"] == "/etc/profile.d/areal-npu-ascend-env.sh"


def test_vllm_is_built_for_an_empty_device():
    assert re.search(r"VLLM_TARGET_DEVICE=empty python3 -m pip install", INSTRUCTIONS)


def test_entry_point_healthcheck_and_shells_load_the_ascend_env():
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/areal-npu-entrypoint"]' in DOCKERFILE
    assert re.search(r'HEALTHCHECK .*CMD \[[^\]]*"areal-npu", "doctor"', INSTRUCTIONS)
    assert "COPY docker/ascend-env.sh /etc/profile.d/areal-npu-ascend-env.sh" in DOCKERFILE
    assert "source /etc/profile.d/areal-npu-ascend-env.sh' >> /etc/bash.bashrc" in DOCKERFILE
    env_script = (ROOT / "docker" / "ascend-env.sh").read_text()
    assert "/usr/local/Ascend/ascend-toolkit/set_env.sh" in env_script
    assert "/usr/local/Ascend/nnal/atb/set_env.sh" in env_script
    assert "areal-npu-ascend-env.sh" in (ROOT / "docker" / "entrypoint.sh").read_text()


def test_entrypoint_sources_the_env_and_runs_the_command(tmp_path: Path):
    """Run the real entry point with the env script path rewritten to a fake set_env.sh tree."""
    fake_toolkit = tmp_path / "usr/local/Ascend/ascend-toolkit"
    fake_toolkit.mkdir(parents=True)
    (fake_toolkit / "set_env.sh").write_text("export ASCEND_TOOLKIT_HOME=/fake/toolkit\nfalse\n")
    env_script = (ROOT / "docker/ascend-env.sh").read_text().replace("/usr/local/Ascend", f"{tmp_path}/usr/local/Ascend")
    (tmp_path / "env.sh").write_text(env_script)
    entry = (ROOT / "docker/entrypoint.sh").read_text().replace(
        "/etc/profile.d/areal-npu-ascend-env.sh", str(tmp_path / "env.sh"))
    (tmp_path / "entry.sh").write_text(entry)
    out = subprocess.run(["bash", str(tmp_path / "entry.sh"), "bash", "-c", 'echo "$ASCEND_TOOLKIT_HOME"; echo "$-"'],
                         capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "/fake/toolkit"

    # Sourced from a strict shell: CANN's script failing inside must not kill it, and the shell's
    # own errexit/nounset come back afterwards.
    out = subprocess.run(["bash", "-c", f'set -eu; . "{tmp_path}/env.sh"; echo "$-" "$ASCEND_TOOLKIT_HOME"'],
                         capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    flags, home = out.stdout.split()
    assert home == "/fake/toolkit" and "e" in flags and "u" in flags


def test_pip_keeps_no_cache_and_no_secrets_are_baked_in():
    for m in re.finditer(r"pip install[^&;]*", INSTRUCTIONS):
        assert "--no-cache-dir" in m.group(0), m.group(0)
    assert env_values()["PIP_NO_CACHE_DIR"] == "1"
    for m in re.finditer(r"^(?:ARG|ENV)\s+(.*)$", INSTRUCTIONS, re.M):
        assert not re.search(r"(TOKEN|PASSWORD|SECRET|API_KEY)", m.group(1), re.I), m.group(0)
    assert "--mount=type=secret" not in DOCKERFILE


def test_layers_are_ordered_for_cache_reuse():
    order = [
        INSTRUCTIONS.index("apt-get install"),
        INSTRUCTIONS.index('"torch-npu==${TORCH_NPU_VERSION}"'),
        INSTRUCTIONS.index("VLLM_TARGET_DEVICE=empty"),
        INSTRUCTIONS.index("/opt/vllm-ascend"),
        INSTRUCTIONS.index("/opt/Megatron-LM"),
        INSTRUCTIONS.index("COPY pyproject.toml"),
        INSTRUCTIONS.index("COPY . /opt/areal-npu"),
    ]
    assert order == sorted(order)


def test_pyproject_requirements_reads_the_extras():
    mod = load("pyproject_requirements")
    data = {"project": {"dependencies": ["numpy>=1.26"],
                        "optional-dependencies": {"npu": ["torch==2.10.0"], "megatron": ["megatron-core==0.16.1", "triton"]}}}
    assert mod.requirements(data, ["npu", "megatron"], {"triton"}) == ["numpy>=1.26", "torch==2.10.0", "megatron-core==0.16.1"]
    out = subprocess.run([sys.executable, str(ROOT / "docker/pyproject_requirements.py"), str(ROOT / "pyproject.toml"),
                          "npu", "megatron", "--drop", "triton"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "torch-npu==2.10.0.post2" in out.stdout.split()
    assert "triton" not in out.stdout.split()


def test_verify_stack_accepts_the_pinned_stack_and_names_drift(tmp_path: Path):
    mod = load("verify_stack")
    pins = mod.read_versions_env(ROOT / "docker/versions.env")
    installed = {dist: pins[key] for dist, (key, _) in mod.DISTRIBUTIONS.items()}
    installed.update({"torch": pins["TORCH_VERSION"] + "+cpu", "vllm": pins["VLLM_VERSION"] + "+empty"})
    heads = {path: pins[key] for path, key in mod.CHECKOUTS.items()}
    env = {"AREAL_NPU_CHIP": "a3", "SOC_VERSION": pins["SOC_VERSION_A3"]}
    manifest, problems = mod.check(pins, installed.get, heads.get, env)
    assert problems == []
    assert manifest["distributions"]["torch-npu"] == pins["TORCH_NPU_VERSION"]
    json.dumps(manifest)

    installed["torch-npu"] = "2.10.0.post4"
    heads["/opt/MindSpeed"] = "0" * 40
    env["SOC_VERSION"] = pins["SOC_VERSION_A2"]
    _, problems = mod.check(pins, installed.get, heads.get, env)
    assert len(problems) == 3
    assert any("torch-npu" in p for p in problems) and any("/opt/MindSpeed" in p for p in problems)
    assert any("SOC_VERSION" in p for p in problems)


def test_versions_table_generator_matches_the_readmes():
    out = subprocess.run([sys.executable, str(ROOT / "docker/versions_table.py")], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    for readme in ("docker/README.md",):
        assert out.stdout.strip() in (ROOT / readme).read_text(), f"run python3 docker/versions_table.py --write ({readme})"
