"""Pipeline parallelism: two gloo ranks as two pipeline stages (and four as two stages of TP=2) (Megatron-Core's 1F1B schedule over
packed micro-batches of different lengths) equal one process holding every layer -- log-probs, PPO
loss, the MTP head's loss, gradient norms, every gradient and every weight after an optimizer step
under HF names (``mtp.*`` included), the weights each stage exports for the rollout sync. What a
stage holds is checked against the layer split (first stage: the embedding and the first half of
the layers; last: the rest, the output head and the MTP head, with its copy of the embedding).
"""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

from areal_npu import names as N  # noqa: E402
from areal_npu.data.packing import PackingConfig  # noqa: E402
from areal_npu.train.dist import init_distributed, process_group  # noqa: E402
from areal_npu.train.optim import OptimConfig  # noqa: E402
from tests.support.device import approx, tolerance  # noqa: E402
from tests.support.megatron_tiny import make_samples, megatron_config, ppo_step, ranks_fit, tiny_qwen3  # noqa: E402
from tests.support.ranks import start_processes  # noqa: E402

LAYERS = 4
CAP = 24  # several micro-batches of different packed lengths


def _engine(pp: int, tp: int = 1):
    from areal_npu.model.mtp import MTPConfig, Qwen35MTP, init_mtp_weights
    from areal_npu.train.config import MegatronLayoutConfig
    from areal_npu.train.megatron.engine import MegatronEngine

    config, hf = tiny_qwen3(num_hidden_layers=LAYERS)
    head = Qwen35MTP(config, 1)
    init_mtp_weights(head, std=0.08, generator=torch.Generator().manual_seed(11))
    cfg = megatron_config(
        packing=PackingConfig(max_tokens_per_mb=CAP), optim=OptimConfig(lr=1e-2, grad_clip=0.05, eps=1e-3)
    )
    cfg.megatron = MegatronLayoutConfig(tp_size=tp, pp_size=pp)
    cfg.validate()  # packing.tp_size follows the layout
    mtp = MTPConfig(enabled=True, num_depths=1, loss_scale=0.3, lr_scale=0.5)
    return MegatronEngine.from_hf_model(hf, cfg, mtp=head, mtp_config=mtp)


def _outputs(engine) -> dict:
    prox, stats, grads = ppo_step(engine, make_samples(6))
    exported = {n: t for _, bucket in engine.export_buckets(bucket_bytes=1 << 14) for n, t in bucket}
    return {
        "prox": prox,
        "stats": stats,
        "grads": grads,
        "weights": dict(engine.full_state_dict()),
        "exported": exported,
        "held": sorted(engine.module.state_dict()),
        "mtp_held": engine.mtp is not None,
    }


def _worker(rank, world, tp, path, init_file):
    with process_group(rank, world, f"file://{init_file}"):
        out = _outputs(_engine(2, tp))
        torch.save(out, f"{path}.{rank}")


@pytest.mark.parametrize(
    "tp", [1, pytest.param(2, marks=pytest.mark.skipif(not ranks_fit(4), reason="4 devices"))]
)
@pytest.mark.skipif(not ranks_fit(2), reason="two ranks need two accelerators on this machine")
def test_two_pipeline_stages_equal_one_process(tmp_path, tp):
    world = 2 * tp
    args = (world, tp, str(tmp_path / "out.pt"), str(tmp_path / "rdv"))
    start_processes(_worker, args=args, nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"out.pt.{r}", weights_only=False) for r in range(world)]
    init_distributed()
    one = _outputs(_engine(1))

    # what each stage holds: the layer split, under Megatron's local layer names
    first, last = (set(ranks[s * tp]["held"]) for s in range(2))  # stage = rank // tp
    assert "embedding.word_embeddings.weight" in first and "embedding.word_embeddings.weight" not in last
    assert "output_layer.weight" in last and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" in last and "decoder.final_layernorm.weight" not in first
    layers = {
        s: {n.split(".")[2] for n in held if n.startswith("decoder.layers.")}
        for s, held in enumerate((first, last))
    }
    assert layers == {0: {"0", "1"}, 1: {"0", "1"}}  # LAYERS / 2 each, numbered from 0 on each stage
    assert [ranks[s * tp]["mtp_held"] for s in range(2)] == [False, True]  # the head beside the output layer

    for two in ranks:  # every rank answers the same, equal to one process
        for got, want in zip(two["prox"], one["prox"], strict=True):
            torch.testing.assert_close(got, want, **tolerance("values", dict(rtol=1e-5, atol=1e-6), want))
        for key in (N.PPO_LOSS, N.TRAIN_GRAD_NORM, N.MTP_LOSS):
            assert two["stats"][key] == pytest.approx(
                one["stats"][key], **approx("values", 1e-5, one["stats"][key])
            ), key
        assert two["stats"][N.TRAIN_N_TOKENS] == one["stats"][N.TRAIN_N_TOKENS]
        assert sorted(two["grads"]) == sorted(one["grads"]) and any(n.startswith("mtp.") for n in one["grads"])
        for name, grad in one["grads"].items():
            torch.testing.assert_close(
                two["grads"][name], grad, **tolerance("grads", dict(rtol=1e-4, atol=1e-7), grad), msg=name
            )
        for key in ("weights", "exported"):
            assert sorted(two[key]) == sorted(one[key]) and any(n.startswith("mtp.") for n in one[key])
            for name, tensor in one[key].items():
                torch.testing.assert_close(
                    two[key][name],
                    tensor,
                    **tolerance("weights", dict(rtol=1e-5, atol=1e-6), tensor),
                    msg=name,
                )
    assert one["stats"][N.PACKING_MICRO_BATCHES] >= 2  # the schedule really interleaved several


def test_pipeline_layouts_the_engine_refuses():
    from areal_npu.train.megatron.model import check_layout

    hf, _ = tiny_qwen3(num_hidden_layers=LAYERS)
    with pytest.raises(ValueError, match="num_hidden_layers=4 is not divisible by pp_size=3"):
        check_layout(hf, 1, 3)
    tied, _ = tiny_qwen3(num_hidden_layers=LAYERS, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie_word_embeddings with pp_size=2"):
        check_layout(tied, 1, 2)


def test_the_stages_hold_every_weight_once_under_local_layer_numbers():
    """Union of the stages' conversions == the one-stage conversion (layer ``i`` of stage ``p`` is
    global layer ``p L/pp + i``); every HF tensor's shape is known to the stages that receive it."""
    import re

    from areal_npu.train.megatron.convert import Stage, hf_shape, hf_to_mcore, rules
    from areal_npu.train.megatron.shape import gpt_shape

    hf_config, hf = tiny_qwen3(num_hidden_layers=LAYERS)
    shape, state = gpt_shape(hf_config), hf.state_dict()
    full = hf_to_mcore(state, shape)
    for pp in (2, 4):
        names = [h for p in range(pp) for r in rules(shape, Stage(p, pp)) for h in r.hf]
        assert sorted(names) == sorted(n for n in state if not n.endswith("inv_freq"))
        seen = set()
        for p in range(pp):
            for name, tensor in hf_to_mcore(state, shape, stage=Stage(p, pp)).items():
                offset = p * LAYERS // pp
                glob = re.sub(r"layers\.(\d+)\.", lambda m, o=offset: f"layers.{int(m[1]) + o}.", name)
                assert torch.equal(tensor, full[glob]), (p, name)
                seen.add(glob)
        assert seen == set(full)
    for name, tensor in state.items():
        assert hf_shape(name, shape) == tuple(tensor.shape), name
