"""HF exports in the published layout: with a small shard limit the weights are several
``model-0000i-of-0000N.safetensors`` files of at most the limit (a larger tensor alone in its own)
plus ``model.safetensors.index.json``; safetensors reads every tensor back bit for bit and
transformers loads the folder (reference: the model's own state dict)."""

import json

import pytest
import torch
from safetensors import safe_open

from areal_npu.model.hf_shards import ShardedSafetensorsWriter
from areal_npu.model.layout import CheckpointLayout
from tests.support.megatron_tiny import tiny_qwen3


def test_a_small_limit_gives_several_shards_and_an_index_transformers_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    config, model = tiny_qwen3()
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    limit = 64 * 1024
    CheckpointLayout().save(tmp_path, iter(state.items()), config, max_shard_bytes=limit)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    n = len(files)
    assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(index["weight_map"]) == sorted(state) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in state.values())
    for name in files:
        with safe_open(str(tmp_path / name), framework="pt") as f:
            held = {k: f.get_tensor(k) for k in f.keys()}
        data = sum(t.numel() * t.element_size() for t in held.values())
        assert data <= limit or len(held) == 1, (name, data)  # a larger tensor is alone in its shard
        for k, t in held.items():
            assert index["weight_map"][k] == name and torch.equal(t, state[k]), k
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for k, t in state.items():
        assert torch.equal(loaded[k], t), k


def test_one_shard_is_model_safetensors_and_a_new_export_replaces_the_old_shards(tmp_path):
    from safetensors.torch import load_file

    w = ShardedSafetensorsWriter(tmp_path, max_shard_bytes=16)
    for i in range(3):
        w.add(f"t{i}", torch.full((4,), float(i)))  # 16 bytes each: one shard each
    assert len(w.finish()) == 3
    w = ShardedSafetensorsWriter(tmp_path)
    w.add("a", torch.arange(3, dtype=torch.bfloat16))
    w.add("b", torch.ones(2, 2, dtype=torch.int64))
    assert w.finish() == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    got = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(got["a"], torch.arange(3, dtype=torch.bfloat16)) and torch.equal(
        got["b"], torch.ones(2, 2, dtype=torch.int64)
    )
    with pytest.raises(ValueError, match="positive"):
        ShardedSafetensorsWriter(tmp_path, 0)


@pytest.mark.parametrize("declared", ["bfloat16", "float32", None])
def test_floating_tensors_take_the_declared_dtype_and_integers_stay(tmp_path, declared):
    """bfloat16 declared: floats rounded by torch's ``.to(torch.bfloat16)``; float32 declared, or no
    dtype at all: written as given; integer tensors unchanged either way; the config file declares
    what was written and the live config is left alone (engine exports in bf16:
    tests/train/test_fsdp2_export_dtype.py, megatron/test_export.py)."""
    config, model = tiny_qwen3(dtype=declared)
    want = getattr(torch, declared) if declared else torch.float32
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    state["step_count"] = torch.arange(3)  # not floating: written as it is
    CheckpointLayout().save(tmp_path, iter(state.items()), config)
    dtypes, written = {}, {}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            dtypes[name], written[name] = f.get_slice(name).get_dtype(), f.get_tensor(name)
    assert dtypes.pop("step_count") == "I64" and torch.equal(
        written.pop("step_count"), state.pop("step_count")
    )
    assert set(dtypes.values()) == {"BF16" if want == torch.bfloat16 else "F32"}
    assert all(torch.equal(written[n], t.to(want)) for n, t in state.items())
    assert json.loads((tmp_path / "config.json").read_text()).get("dtype") == declared
    assert config.dtype == (want if declared else None)
