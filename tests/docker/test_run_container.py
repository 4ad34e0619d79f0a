"""scripts/run_container.sh --dry-run against fake A2 / A3 device trees built in tmp_path."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "run_container.sh"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
MANAGEMENT_NODES = ("/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")
HOST_MOUNTS = ("/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi", "/etc/ascend_install.info")


def fake_node(root: Path, npus: int, *, management: bool = True, mounts: bool = True) -> Path:
    """A device tree like an Ascend node's: /dev/davinci0..npus-1 and the rest."""
    (root / "dev").mkdir(parents=True)
    for i in range(npus):
        (root / f"dev/davinci{i}").touch()
    if management:
        for node in MANAGEMENT_NODES:
            (root / node.lstrip("/")).touch()
    (root / "dev/davinci_something_else").touch()  # must not be taken for an NPU
    if mounts:
        (root / "usr/local/Ascend/driver/lib64").mkdir(parents=True)
        (root / "usr/local/dcmi").mkdir(parents=True)
        (root / "usr/local/bin").mkdir(parents=True)
        (root / "usr/local/bin/npu-smi").touch()
        (root / "etc").mkdir()
        (root / "etc/ascend_install.info").write_text("Driver_Install_Path_Param=/usr/local/Ascend\n")
    return root


def run(*args: str, dev_root: Path | None = None, env_extra: dict | None = None, cwd: Path | None = None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("AREAL_NPU_DEV_ROOT", "HCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "HF_TOKEN")}
    if dev_root is not None:
        env["AREAL_NPU_DEV_ROOT"] = str(dev_root)
    env.update(env_extra or {})
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          cwd=cwd or ROOT, timeout=30, stdin=subprocess.DEVNULL)


def parse(stdout: str) -> list[str]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, stdout
    return shlex.split(lines[0])


def values(argv: list[str], flag: str) -> list[str]:
    return [b for a, b in zip(argv, argv[1:], strict=False) if a == flag]


@pytest.mark.parametrize(("chip", "npus"), [("a2", 8), ("a3", 16)])
def test_dry_run_for_a_node(tmp_path: Path, chip: str, npus: int):
    root = fake_node(tmp_path / "node", npus)
    work = tmp_path / "work"
    work.mkdir()
    out = run("--dry-run", "--workdir", str(work), "--", "areal-npu", "doctor", dev_root=root)
    assert out.returncode == 0, out.stderr
    argv = parse(out.stdout)
    assert argv[:2] == ["docker", "run"]

    devices = values(argv, "--device")
    want = [f"/dev/davinci{i}" for i in range(npus)] + list(MANAGEMENT_NODES)
    assert devices == [f"{root}{path}:{path}" for path in want]

    volumes = values(argv, "--volume")
    for mount in HOST_MOUNTS:
        assert f"{root}{mount}:{mount}:ro" in volumes
    assert f"{work}:/workspace" in volumes
    assert values(argv, "--workdir") == ["/workspace"]
    assert values(argv, "--network") == ["host"]
    assert values(argv, "--shm-size") == ["64g"]

    image_at = argv.index(f"areal-npu:{VERSION}-{chip}")
    assert argv[image_at + 1:] == ["areal-npu", "doctor"]


def test_dev_root_flag_and_device_subset(tmp_path: Path):
    root = fake_node(tmp_path / "node", 16)
    out = run("--dry-run", "--dev-root", str(root), "--devices", "2,3", "--shm-size", "128g",
              "--image", "reg.example/areal-npu:x-a3", "--name", "trial")
    assert out.returncode == 0, out.stderr
    argv = parse(out.stdout)
    assert values(argv, "--device")[:2] == [f"{root}/dev/davinci2:/dev/davinci2", f"{root}/dev/davinci3:/dev/davinci3"]
    assert len(values(argv, "--device")) == 2 + len(MANAGEMENT_NODES)
    assert values(argv, "--shm-size") == ["128g"]
    assert values(argv, "--name") == ["trial"]
    assert argv[-1] == "reg.example/areal-npu:x-a3"


def test_node_settings_pass_through_by_name_only(tmp_path: Path):
    root = fake_node(tmp_path / "node", 8)
    out = run("--dry-run", dev_root=root, env_extra={"HCCL_SOCKET_IFNAME": "eth0", "HF_TOKEN": "hf_secret"})
    assert out.returncode == 0, out.stderr
    argv = parse(out.stdout)
    assert {"HCCL_SOCKET_IFNAME", "HF_TOKEN"} <= set(values(argv, "--env"))
    assert "hf_secret" not in out.stdout


def test_unusual_device_count_needs_chip(tmp_path: Path):
    root = fake_node(tmp_path / "node", 7)
    out = run("--dry-run", dev_root=root)
    assert out.returncode == 2
    assert "found 7 NPUs" in out.stderr and "--chip" in out.stderr
    out = run("--dry-run", "--chip", "a2", dev_root=root)
    assert out.returncode == 0, out.stderr
    assert len(values(parse(out.stdout), "--device")) == 7 + len(MANAGEMENT_NODES)


def test_more_devices_than_the_chip_has(tmp_path: Path):
    root = fake_node(tmp_path / "node", 16)
    out = run("--dry-run", "--chip", "a2", dev_root=root)
    assert out.returncode == 2 and "more than an a2 node has" in out.stderr


def test_not_an_ascend_node(tmp_path: Path):
    out = run("--dry-run", dev_root=tmp_path)
    assert out.returncode == 2 and "not an Ascend node" in out.stderr
    root = fake_node(tmp_path / "node", 8, management=False)
    out = run("--dry-run", dev_root=root)
    assert out.returncode == 2 and "davinci_manager" in out.stderr


def test_missing_host_mounts_warn_and_are_left_out(tmp_path: Path):
    root = fake_node(tmp_path / "node", 8, mounts=False)
    out = run("--dry-run", dev_root=root)
    assert out.returncode == 0, out.stderr
    assert "npu-smi not found" in out.stderr
    assert all(not v.endswith(":ro") for v in values(parse(out.stdout), "--volume"))


def test_unknown_device_id_is_rejected(tmp_path: Path):
    root = fake_node(tmp_path / "node", 8)
    out = run("--dry-run", "--devices", "0,9", dev_root=root)
    assert out.returncode == 2 and "davinci9" in out.stderr


def test_help():
    out = run("--help")
    assert out.returncode == 0 and "--dev-root" in out.stdout
