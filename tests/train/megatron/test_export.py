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
