"""Recipe loading: defaults <- YAML <- dotted overrides; bad input names the key."""

from dataclasses import dataclass, field

import pytest

from areal_npu.config import ConfigError, ExperimentConfig, load_config, to_yaml


@dataclass
class OptimConfig:
    lr: float = 1e-3
    warmup_steps: int = 10
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])

    def validate(self):
        if self.warmup_steps < 0:
            raise ValueError("warmup_steps must be >= 0")


@dataclass
class RecipeConfig(ExperimentConfig):
    optim: OptimConfig = field(default_factory=OptimConfig)


def test_layers_apply_in_order(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: demo\noptim:\n  lr: 0.5\n  warmup_steps: 3\n")
    cfg = load_config(RecipeConfig, recipe, ["optim.lr=0.25", "seed=7"])
    assert (cfg.name, cfg.seed, cfg.optim.lr, cfg.optim.warmup_steps) == ("demo", 7, 0.25, 3)
    assert cfg.run_dir == "runs/demo"  # interpolation resolved
    assert isinstance(cfg.optim, OptimConfig)
    assert "lr: 0.25" in to_yaml(cfg)


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (["optim.lrr=1"], "optim.lrr", "did you mean 'optim.lr'"),
        (["seeed=1"], "seeed", "did you mean 'seed'"),
        (["optim.lr=fast"], "optim.lr", "wrong type"),
        (["optim.warmup_steps=-1"], "optim.warmup_steps", ">= 0"),
        (["device=tpu"], "device", "auto, npu, cuda, cpu"),
        (["optim.zzz=1"], "optim.zzz", "unknown key. Valid keys here: betas, lr, warmup_steps"),
        (["lr=1"], "lr", "did you mean 'optim.lr'"),  # the key one level down (train --help's old example)
        (["justaword"], "justaword", "a.b.c=value"),
    ],
)
def test_bad_input_names_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(RecipeConfig, None, overrides)
    assert info.value.key == key
    assert fragment in str(info.value)


def test_misspelt_key_in_yaml(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  warmup_step: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'optim.warmup_steps'"):
        load_config(RecipeConfig, recipe)


def test_missing_and_broken_recipe(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(RecipeConfig, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(RecipeConfig, bad)


def _machine_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_device_is_resolved_on_this_machine(monkeypatch):
    monkeypatch.delenv("AREAL_NPU_DEVICE", raising=False)
    from areal_npu.platform import detect_platform

    assert load_config(RecipeConfig, None, ["device=cpu"]).device == "cpu"
    # auto becomes what the device seam detects here, so what is printed is what runs
    assert load_config(RecipeConfig, None, []).device == detect_platform().device_type


@pytest.mark.skipif(_machine_has_cuda(), reason="needs a machine without CUDA")
def test_device_the_machine_lacks_is_refused(monkeypatch):
    monkeypatch.delenv("AREAL_NPU_DEVICE", raising=False)
    with pytest.raises(ConfigError) as info:
        load_config(RecipeConfig, None, ["device=cuda"])
    assert info.value.key == "device" and "torch.cuda.is_available() is false" in str(info.value)


def test_device_that_disagrees_with_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("AREAL_NPU_DEVICE", "cpu")
    with pytest.raises(ConfigError) as info:
        load_config(RecipeConfig, None, ["device=npu"])
    assert info.value.key == "device" and "AREAL_NPU_DEVICE=cpu" in str(info.value)


@dataclass
class ChildConfig:
    mode: str = "auto"

    def validate(self):
        if self.mode == "auto":
            raise ValueError("mode must be resolved before it is validated")


@dataclass
class ParentConfig:
    child: ChildConfig = field(default_factory=ChildConfig)

    def pre_validate(self):
        self.child.mode = "resolved"  # a field the parent derives for its child

    def validate(self):
        if self.child.mode != "resolved":
            raise ValueError("child was not given the derived value")


def test_pre_validate_runs_before_the_children():
    assert load_config(ParentConfig, None, []).child.mode == "resolved"
