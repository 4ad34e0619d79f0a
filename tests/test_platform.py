"""The device seam on simulated machines: no accelerator, a working torch_npu, a broken torch_npu."""

import importlib
import os
import subprocess
import sys
import textwrap
import types

import pytest

from areal_npu import platform as plat


def _importer(torch_npu):
    """An import function where `torch_npu` is the given module, or raises the given exception."""

    def import_module(name):
        if name == "torch_npu":
            if isinstance(torch_npu, BaseException):
                raise torch_npu
            if torch_npu is None:
                raise ModuleNotFoundError("No module named 'torch_npu'")
            return torch_npu
        return importlib.import_module(name)

    return import_module


def _fake_torch_npu(available=True):
    module = types.ModuleType("torch_npu")
    module.__version__ = "2.10.0.post2"
    module.npu = types.SimpleNamespace(is_available=lambda: available)
    return module


def test_no_accelerator_is_cpu_with_gloo():
    p = plat.detect_platform(env={}, import_module=_importer(None), cuda_available=lambda: False)
    assert (p.device_type, p.dist_backend, p.visible_devices_env, p.ray_resource) == (
        "cpu",
        "gloo",
        None,
        "CPU",
    )
    assert p.warning is None


def test_working_torch_npu_is_npu_with_hccl():
    p = plat.detect_platform(env={}, import_module=_importer(_fake_torch_npu()), cuda_available=lambda: True)
    assert (p.device_type, p.dist_backend) == ("npu", "hccl")
    assert p.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert p.ray_resource == "NPU"
    assert p.torch_npu_version == "2.10.0.post2"


@pytest.mark.parametrize(
    "error", [OSError("libhccl.so: cannot open shared object file"), ImportError("boom")]
)
def test_broken_torch_npu_falls_back_with_one_warning(error):
    p = plat.detect_platform(env={}, import_module=_importer(error), cuda_available=lambda: False)
    assert p.device_type == "cpu"
    assert "torch_npu is installed but failed to import" in p.warning
    assert "libhccl" in p.warning or "boom" in p.warning


def test_torch_npu_without_devices_falls_back_to_cuda():
    p = plat.detect_platform(
        env={}, import_module=_importer(_fake_torch_npu(False)), cuda_available=lambda: True
    )
    assert (p.device_type, p.dist_backend, p.visible_devices_env) == ("cuda", "nccl", "CUDA_VISIBLE_DEVICES")


def test_env_override_and_bad_value():
    p = plat.detect_platform(env={"AREAL_NPU_DEVICE": "cpu"}, import_module=_importer(_fake_torch_npu()))
    assert p.device_type == "cpu"
    with pytest.raises(ValueError, match="AREAL_NPU_DEVICE"):
        plat.detect_platform(env={"AREAL_NPU_DEVICE": "tpu"})
    with pytest.raises(RuntimeError, match="no usable NPU"):
        plat.detect_platform(env={"AREAL_NPU_DEVICE": "npu"}, import_module=_importer(None))


def test_cpu_memory_stats_and_device():
    p = plat.detect_platform(env={"AREAL_NPU_DEVICE": "cpu"})
    stats = p.memory_stats()
    assert stats["mem/rss_gib"] > 0.01
    assert str(p.device()) == "cpu"
    with pytest.raises(RuntimeError, match="not running on an Ascend NPU"):
        plat.import_torch_npu()


def test_import_with_torch_npu_that_breaks_torch_autoload(tmp_path):
    """A torch_npu whose import fails (CANN missing) must not break `import areal_npu` or torch.

    The fake package registers a torch device-backend autoload entry point, exactly like the real
    wheel; without areal_npu switching autoload off, `import torch` itself would raise.
    """
    site = tmp_path / "site"
    pkg = site / "torch_npu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise OSError('libhccl.so: cannot open shared object file')\n")
    (pkg / "autoload.py").write_text("def _autoload():\n    import torch_npu\n")
    dist = site / "torch_npu-2.10.0.post2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.10.0.post2\n")
    (dist / "entry_points.txt").write_text(
        "[torch.backends]\ndevice_backend = torch_npu.autoload:_autoload\n"
    )
    code = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import areal_npu.platform as p
            import torch
            torch.cuda.is_available = lambda: False  # simulate no GPU: the fallback must be the CPU anywhere
            platform = p.current_platform()
        print(platform.device_type, sum("torch_npu is installed but failed" in str(w.message) for w in caught))
        """
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("TORCH_DEVICE_BACKEND_AUTOLOAD", "AREAL_NPU_DEVICE")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["cpu", "1"]
    # Control: with autoload left on, the same fake breaks `import torch` -- the case the seam exists for.
    bare = subprocess.run(
        [sys.executable, "-c", "import torch"],
        env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bare.returncode != 0 and "libhccl" in bare.stderr


# A recipe's `device:` against simulated machines. Reference: what each machine has, written out.
_MACHINES = {
    "cpu only": dict(import_module=_importer(None), cuda_available=lambda: False),
    "cuda": dict(import_module=_importer(None), cuda_available=lambda: True),
    "npu": dict(import_module=_importer(_fake_torch_npu()), cuda_available=lambda: False),
    "broken npu": dict(import_module=_importer(OSError("libhccl.so")), cuda_available=lambda: False),
}
_HAS = {"cpu only": {"cpu"}, "cuda": {"cpu", "cuda"}, "npu": {"cpu", "npu"}, "broken npu": {"cpu"}}


@pytest.mark.parametrize("machine", sorted(_MACHINES))
@pytest.mark.parametrize("requested", ["cpu", "cuda", "npu"])
def test_requested_device_is_used_when_the_machine_has_it(machine, requested):
    if requested in _HAS[machine]:
        p = plat.select_device(requested, env={}, **_MACHINES[machine])
        assert (p.device_type, p.dist_backend) == (requested, {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[requested])
    else:
        with pytest.raises(ValueError, match=f"'{requested}' but"):
            plat.select_device(requested, env={}, **_MACHINES[machine])


def test_requested_device_that_disagrees_with_the_environment_is_refused():
    machine = _MACHINES["cuda"]
    with pytest.raises(ValueError, match="disagrees with AREAL_NPU_DEVICE=cpu"):
        plat.select_device("cuda", env={"AREAL_NPU_DEVICE": "cpu"}, **machine)
    assert plat.select_device("cpu", env={"AREAL_NPU_DEVICE": "cpu"}, **machine).device_type == "cpu"
    assert plat.select_device("auto", env={"AREAL_NPU_DEVICE": "cpu"}, **machine).device_type == "cpu"
    assert plat.select_device("auto", env={}, **machine).device_type == "cuda"


def test_use_device_makes_it_this_process_platform(monkeypatch):
    monkeypatch.setenv("AREAL_NPU_DEVICE", "")  # records the original so that it is restored: use_device
    monkeypatch.delenv("AREAL_NPU_DEVICE")  # writes os.environ itself, and delenv of an unset name records nothing
    plat.current_platform.cache_clear()
    try:
        assert plat.use_device("cpu").device_type == "cpu"
        assert os.environ["AREAL_NPU_DEVICE"] == "cpu"  # inherited by the engines and ranks it starts
        assert plat.current_platform().device_type == "cpu"
    finally:
        plat.current_platform.cache_clear()
