"""The Megatron GPTModel built from an HF Qwen3: packed THD logits equal transformers' per sequence."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

from areal_npu.data.packed_layout import pack_sequences, unpack_per_token  # noqa: E402
from areal_npu.train.dist import init_distributed  # noqa: E402
from tests.support.device import test_device, tolerance  # noqa: E402
from tests.support.megatron_tiny import tiny_qwen3  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()
    from areal_npu.train.megatron.runtime import init_parallel_state

    init_parallel_state(1, 1)


def _megatron(config, hf):
    from areal_npu.train.megatron.convert import hf_to_mcore
    from areal_npu.train.megatron.model import build_gpt_model
    from areal_npu.train.megatron.shape import gpt_shape

    model = build_gpt_model(config)
    missing, unexpected = model.load_state_dict(hf_to_mcore(hf.state_dict(), gpt_shape(config)), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_packed_logits_equal_transformers_per_sequence(tied):
    """fp32 both sides; on the CPU the same matmuls in the same order give bit-equal logits (measured
    max |diff| 0.0 against max |logit| ~0.6), so 1e-5 is a loose bound that still catches any
    mapping error: one fused-QKV element off by 0.1 moves the logits by 1e-2. The model runs on the
    platform's device, the reference on the CPU (:mod:`tests.support.device`)."""
    from areal_npu.train.megatron.packing import to_megatron

    config, hf = tiny_qwen3(tie_word_embeddings=tied)
    model = _megatron(config, hf)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 320, (n,), generator=g) for n in (7, 12, 1, 5)]
    batch = pack_sequences(seqs, alignment=4)
    assert batch.alignment_pad_tokens > 0  # a padding segment of its own is part of the row
    mb = to_megatron(batch, {}, device=test_device())
    with torch.no_grad():
        logits = model(mb.input_ids[None], mb.position_ids[None], None, packed_seq_params=mb.params)[0]
        for seq, got in zip(seqs, unpack_per_token(logits.cpu(), batch)):
            want = hf(input_ids=seq[None]).logits[0]
            torch.testing.assert_close(got, want, **tolerance("values", dict(rtol=1e-5, atol=1e-5), want))


def test_decoder_hidden_states_are_what_the_output_layer_reads():
    from areal_npu.train.megatron.model import decoder_hidden_states
    from areal_npu.train.megatron.packing import to_megatron

    config, hf = tiny_qwen3()
    model = _megatron(config, hf)
    seqs = [torch.arange(9), torch.arange(40, 46)]
    batch = pack_sequences(seqs)
    mb = to_megatron(batch, {}, device=test_device())
    with torch.no_grad():
        hidden = decoder_hidden_states(model, mb.input_ids, mb.position_ids, mb.params)
        for seq, got in zip(seqs, unpack_per_token(hidden.cpu(), batch)):
            want = hf.model(input_ids=seq[None]).last_hidden_state[0]
            torch.testing.assert_close(got, want, **tolerance("values", dict(rtol=1e-5, atol=1e-5), want))


def test_qwen35_moe_and_next_are_refused_with_a_sentence():
    """Dense Qwen3.5/3.6 are built (``test_hybrid.py``); their MoE variants and Qwen3-Next are not."""
    from types import SimpleNamespace

    from areal_npu.model.tiny import TinyModelConfig, hf_config
    from areal_npu.train.megatron.model import check_supported

    check_supported(hf_config(TinyModelConfig(linear_attention_every=2)), "cpu")  # no error
    for model_type in ("qwen3_5_moe_text", "qwen3_next"):
        config = SimpleNamespace(model_type=model_type, layer_types=["linear_attention", "full_attention"])
        with pytest.raises(
            NotImplementedError, match=f"{model_type}: the Megatron engine maps dense Qwen3.5"
        ):
            check_supported(config, "cpu")
