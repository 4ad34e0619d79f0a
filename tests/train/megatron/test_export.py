"""Bucketed export under HF names: every tensor once, buckets bounded, and the export loads into
transformers and computes what the Megatron model computes."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from areal_npu.data.packing import PackingConfig  # noqa: E402
from areal_npu.data.sample import TrainSample  # noqa: E402
from areal_npu.train.dist import init_distributed  # noqa: E402
from areal_npu.train.losses import SFTLoss  # noqa: E402
from areal_npu.train.optim import OptimConfig  # noqa: E402
from tests.support.device import tolerance  # noqa: E402
from tests.support.megatron_tiny import make_samples, megatron_config, reference_logprobs, tiny_qwen3  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


def test_convert_round_trips_every_tp_split():
    from areal_npu.train.megatron.convert import hf_to_mcore, mcore_to_hf
    from areal_npu.train.megatron.shape import gpt_shape

    config, hf = tiny_qwen3()
    state = hf.state_dict()
    shape = gpt_shape(config)
    for tp in (1, 2):
        shards = [hf_to_mcore(state, shape, r, tp) for r in range(tp)]
        back = dict(mcore_to_hf(shards, shape))
        assert sorted(back) == sorted(state)
        assert all(torch.equal(back[n], state[n]) for n in state)
    with pytest.raises(KeyError, match="lacks"):
        hf_to_mcore({k: v for k, v in state.items() if "q_norm" not in k}, shape)
    with pytest.raises(KeyError, match="no Megatron counterpart"):
        hf_to_mcore({**state, "model.extra.weight": torch.zeros(1)}, shape)


def test_export_buckets_load_into_transformers_with_the_same_logits():
    from transformers import Qwen3ForCausalLM

    from areal_npu.train.megatron.engine import MegatronEngine

    config, hf = tiny_qwen3()
    engine = MegatronEngine.from_hf_model(
        hf, megatron_config(packing=PackingConfig(max_tokens_per_mb=64), optim=OptimConfig(lr=1e-2))
    )
    samples = [TrainSample(input_ids=s.input_ids, loss_mask=s.loss_mask) for s in make_samples()]
    engine.train_step(samples, SFTLoss())  # exported weights differ from the ones loaded
    limit = 20_000
    buckets = list(engine.export_buckets(bucket_bytes=limit))
    names = [n for _, b in buckets for n, _ in b]
    assert len(names) == len(set(names)) and sorted(names) == sorted(hf.state_dict())
    assert all(kind == "policy" for kind, _ in buckets) and len(buckets) > 3
    for _, bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= limit or len(bucket) == 1
    loaded = Qwen3ForCausalLM(config).float().eval()
    loaded.load_state_dict(dict(kv for _, b in buckets for kv in b), strict=True)
    assert not torch.equal(loaded.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    for s, lp in zip(samples, engine.compute_logprobs(samples)):
        want = reference_logprobs(loaded.double(), s.input_ids).detach()
        torch.testing.assert_close(lp.double(), want, **tolerance("values", dict(rtol=1e-5, atol=1e-5), want))


def test_a_bf16_checkpoint_is_exported_in_bf16_from_the_fp32_masters(tmp_path):
    """``config.json`` declaring bfloat16 (as Qwen3.5/3.6 ship): the export's floating tensors, read
    back by the safetensors library, are BF16 and equal the fp32 masters (gathered by hand,
    ``optimizer_state_by_hand``) rounded by torch's ``.to(torch.bfloat16)``; several shards with an
    index of 2 bytes an element; the saved config declares bfloat16; an engine loaded from the
    export exports the same bits again."""
    import json

    from safetensors import safe_open

    from areal_npu.testing.load_memory import write_checkpoint
    from areal_npu.train.megatron.checkpoint import write_hf_checkpoint
    from areal_npu.train.megatron.engine import MegatronEngine
    from tests.support.megatron_tiny import optimizer_state_by_hand

    config, _ = tiny_qwen3(dtype="bfloat16")
    write_checkpoint(tmp_path / "src", config, shard_bytes=1 << 16)  # fp32 values: not bf16 ones
    cfg = megatron_config(packing=PackingConfig(max_tokens_per_mb=64), optim=OptimConfig(lr=1e-2))
    engine = MegatronEngine.from_checkpoint(tmp_path / "src", cfg)
    engine.train_step(
        [TrainSample(input_ids=s.input_ids, loss_mask=s.loss_mask) for s in make_samples()], SFTLoss()
    )
    masters = optimizer_state_by_hand(engine)["master"]
    out = write_hf_checkpoint(engine, tmp_path / "export", max_shard_bytes=1 << 16)
    written, total = {}, 0
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                assert f.get_slice(name).get_dtype() == "BF16", name
                written[name] = f.get_tensor(name)
                total += written[name].numel() * 2
    assert sorted(written) == sorted(masters) and len(list(out.glob("*.safetensors"))) > 2
    rounded = 0
    for name, master in masters.items():
        master = master.cpu()
        assert master.dtype == torch.float32
        assert torch.equal(written[name], master.to(torch.bfloat16)), name
        rounded += int(not torch.equal(written[name].float(), master))
    assert rounded == len(masters)  # every tensor lost bits: the export is not the fp32 masters
    assert json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"] == total
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    again = write_hf_checkpoint(MegatronEngine.from_checkpoint(out, cfg), tmp_path / "again")
    seen = set()
    for path in again.glob("*.safetensors"):  # bf16 -> fp32 masters -> bf16: the same bits
        with safe_open(str(path), framework="pt") as f:
            seen.update(f.keys())
            assert all(torch.equal(f.get_tensor(n), written[n]) for n in f.keys())
    assert seen == set(written)
