"""The FSDP2 engine built on the meta device, each rank reading only its rows of the checkpoint
(``FSDPEngine.from_checkpoint``, :mod:`areal_npu.train.fsdp2_stream`), equals the engine built from
the whole model loaded by transformers (``load_for_training``, the reference): every weight (HF
names, fp32 masters), the rotary tables, the log-probs of a batch and the weights after a PPO
step -- on two gloo ranks, for a
published Qwen3.5 checkpoint (fp32; vision tower carried, MTP head read from ``mtp.*``) and a text
one in bf16 without a head (a new one, the same draw in both engines).
"""

import pytest
import torch

from areal_npu.model.mtp import MTPConfig
from areal_npu.train.dist import process_group
from tests.support.megatron_tiny import make_samples, ppo_step
from tests.support.ranks import start_processes

pytestmark = pytest.mark.distributed


def _engines(src, mtp):
    from areal_npu.model.layout import load_for_training
    from areal_npu.model.mtp_checkpoint import build_mtp_head
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.fsdp2 import FSDPEngine

    torch.manual_seed(5)  # a new head: its draw is the first
    streamed = FSDPEngine.from_checkpoint(src, TrainEngineConfig(), mtp, pad_token_id=0)
    lm, head, layout = load_for_training(src, mtp)
    torch.manual_seed(5)  # the same draw, made apart (transformers' loader draws too)
    head.load_state_dict(build_mtp_head(lm.config, mtp, src).state_dict())
    return streamed, FSDPEngine(lm, head, TrainEngineConfig(), mtp, pad_token_id=0, layout=layout)


def _worker(rank, world, src, mtp, rdv, out):
    with process_group(rank, world, f"file://{rdv}"):
        streamed, loaded = _engines(src, mtp)
        result = {
            "weights": [dict(e.full_state_dict()) for e in (streamed, loaded)],
            "rotary": [dict(e.lm.model.rotary_emb.named_buffers()) for e in (streamed, loaded)],
            "layout": streamed.layout.kind,
            # a save checks that the trained text config is the published config's own
            "one_config": streamed.layout.kind != "published"
            or streamed.layout.config.text_config is streamed.lm.config,
        }
        steps = [
            ppo_step(e, make_samples(4), lambda e: None) for e in (streamed, loaded)
        ]  # the optimizer holds the shards
        result["logp"] = [prox for prox, _, _ in steps]
        result["after"] = [dict(e.full_state_dict()) for e in (streamed, loaded)]
        torch.save(result, f"{out}.{rank}")


@pytest.mark.parametrize("layout", ["published", "text"])
def test_streamed_fsdp2_engine_equals_the_one_built_from_the_whole_model(tmp_path, layout):
    from safetensors.torch import load_file, save_file

    from areal_npu.model.tiny import TinyModelConfig, save_tiny_model

    tiny = TinyModelConfig(layout=layout, hidden_size=64, head_dim=16, linear_head_dim=0)
    src = save_tiny_model(tmp_path / "src", tiny)
    if layout == "text":  # bf16 on disk (as Qwen ship), fp32 masters in the engine; no head: a new one
        tensors = {k: v.bfloat16() for k, v in load_file(str(src / "model.safetensors")).items()}
        save_file(
            {k: v for k, v in tensors.items() if not k.startswith("mtp.")}, str(src / "model.safetensors")
        )
    mtp = MTPConfig(enabled=True, train=True, init_new_head=layout == "text")
    start_processes(_worker, args=(2, str(src), mtp, str(tmp_path / "rdv"), str(tmp_path / "out")), nprocs=2)
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}", weights_only=False)
        assert got["layout"] == layout and got["one_config"]
        streamed, loaded = got["weights"]
        assert sorted(streamed) == sorted(loaded) and any(n.startswith("mtp.") for n in streamed)
        for name in loaded:
            assert torch.equal(streamed[name], loaded[name]), name
        for name, value in got["rotary"][1].items():
            assert torch.equal(got["rotary"][0][name], value), name
        for a, b in zip(*got["logp"]):
            assert torch.equal(a, b)
        streamed, loaded = got["after"]  # one PPO step later
        assert any(not torch.equal(loaded[n], got["weights"][1][n]) for n in loaded)
        for name in loaded:
            assert torch.equal(streamed[name], loaded[name]), name
