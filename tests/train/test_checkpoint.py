"""Checkpoints written by the real engine carry a manifest (checked against zlib here), and
``--resume`` falls back from a damaged checkpoint to the newest intact one, or stops with exit 2
naming the broken file."""

import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from areal_npu.config import ConfigError
from areal_npu.data.sample import TrainSample
from areal_npu.train.checkpoint import checkpoint_to_resume
from areal_npu.train.dist import init_distributed
from areal_npu.train.losses import SFTLoss
from tests.train.test_engine import make_engine, make_samples


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Two checkpoints, step_1 and step_2, of a tiny engine trained one SFT step between them."""
    init_distributed()
    engine, _ = make_engine()
    samples = [TrainSample(input_ids=s.input_ids, loss_mask=s.loss_mask) for s in make_samples()]
    root = tmp_path_factory.mktemp("run") / "checkpoints"
    for step in range(2):
        engine.train_step(samples, SFTLoss())
        engine.save_checkpoint(root, extra={"step": step})
    return root


@pytest.fixture
def root(written, tmp_path):
    copy = tmp_path / "checkpoints"
    shutil.copytree(written, copy)
    return copy


def test_manifest_lists_every_file_with_its_size_and_crc32(root):
    step = root / "step_2"
    manifest = json.loads((step / "manifest.json").read_text())
    on_disk = {
        os.path.relpath(os.path.join(d, f), step)
        for d, _, files in os.walk(step)
        for f in files
        if f != "manifest.json"
    }
    assert set(manifest["files"]) == on_disk
    assert {"model.safetensors", "optim.pt", "trainer_state.json", "config.json", "rng_rank0.pt"} <= on_disk
    for state in ("master", "exp_avg", "exp_avg_sq"):  # the sharded fp32 state (one rank here)
        assert {f"optim/{state}/.metadata", f"optim/{state}/__0_0.distcp"} <= on_disk
    for name, entry in manifest["files"].items():
        data = (step / name).read_bytes()
        assert entry == {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name


def test_intact_latest_is_resumed_without_warnings(root):
    warnings = []
    assert checkpoint_to_resume(root, warnings.append) == root / "step_2"
    assert warnings == []


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)  # what a lost page cache leaves behind


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    path.write_bytes(bytes(data))


def test_truncated_latest_falls_back_to_the_newest_intact_with_a_warning(root):
    _truncate(root / "step_2" / "model.safetensors")
    warnings = []
    chosen = checkpoint_to_resume(root, warnings.append)
    assert chosen == root / "step_1"
    [warning] = warnings
    assert "step_1" in warning and str(root / "step_2" / "model.safetensors") in warning
    engine, _ = make_engine()
    assert engine.load_checkpoint(chosen) == {"step": 0} and engine.version == 1  # it really loads


def test_corrupted_bytes_of_the_same_size_are_caught(root):
    _flip_a_byte(root / "step_2" / "optim.pt")
    warnings = []
    assert checkpoint_to_resume(root, warnings.append) == root / "step_1"
    assert str(root / "step_2" / "optim.pt") in warnings[0] and "CRC-32" in warnings[0]


@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte])
def test_a_damaged_optimizer_shard_falls_back_to_the_previous_checkpoint(root, damage):
    """The FSDP2 engine's sharded state: each rank's DCP shard of the parameters and moments."""
    shard = root / "step_2" / "optim" / "exp_avg" / "__0_0.distcp"
    damage(shard)
    warnings = []
    assert checkpoint_to_resume(root, warnings.append) == root / "step_1"
    assert str(shard) in warnings[0]


def test_no_intact_checkpoint_is_a_config_error_naming_each_broken_file(root):
    _truncate(root / "step_2" / "model.safetensors")
    (root / "step_1" / "trainer_state.json").unlink()
    with pytest.raises(ConfigError) as info:
        checkpoint_to_resume(root, print)
    message = str(info.value)
    assert str(root / "step_2" / "model.safetensors") in message
    assert str(root / "step_1" / "trainer_state.json") in message


def test_older_checkpoint_without_manifest_is_resumed_after_a_structure_check(root):
    """Written before manifests existed: accepted with a warning when its files are whole, refused
    (naming the file) when the safetensors header does not cover the file."""
    for step in ("step_1", "step_2"):
        (root / step / "manifest.json").unlink()
    warnings = []
    assert checkpoint_to_resume(root, warnings.append) == root / "step_2"
    assert len(warnings) == 1 and "no manifest.json" in warnings[0]
    _truncate(root / "step_2" / "model.safetensors")
    _truncate(root / "step_1" / "model.safetensors")
    with pytest.raises(ConfigError, match="model.safetensors"):
        checkpoint_to_resume(root, warnings.append)


def test_cli_resume_without_an_intact_checkpoint_exits_2_naming_the_file(root, tmp_path):
    run_dir = root.parent
    for step in ("step_1", "step_2"):
        _truncate(root / step / "model.safetensors")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: demo\nrun_dir: {run_dir}\n")
    exe = shutil.which("areal-npu", path=os.path.dirname(sys.executable))
    argv = [exe] if exe else [sys.executable, "-m", "areal_npu.cli"]
    out = subprocess.run(
        argv + ["train", str(recipe), "--resume"], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )  # not from the repository root: its kernels/ must not shadow the `kernels` library
    assert out.returncode == 2, out.stderr[-3000:]
    assert str(root / "step_2" / "model.safetensors") in out.stderr
    assert "Traceback" not in out.stderr
    assert not (run_dir / "engines").exists()  # stopped before any work started
