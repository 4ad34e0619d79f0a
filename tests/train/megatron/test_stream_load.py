"""Each rank reads only its shards of an HF checkpoint (:mod:`areal_npu.train.megatron.stream`).

Reference: the full tensors, read by ``safetensors.torch.load_file`` (not by the reader under test)
and cut by :func:`convert.hf_to_mcore` -- the table whose Megatron model reproduces transformers'
logits (test_model) -- and, for the vocabulary and row-parallel weights, cut by hand. Memory: two
gloo ranks (Megatron TP=2, or the FSDP2 engine sharded in two), each a fresh process, stream a
~250 MB fp32 checkpoint of 5 shards; each rank's peak resident growth while building and loading is
bounded by 0.6 x the checkpoint (it holds half of it) + 64 MiB, where loading the whole model first
cost 1.1-1.5 x (``docs/BENCHMARKS.md``).
"""

import json

import pytest
import torch

pytest.importorskip("megatron.core")

from areal_npu.model.safetensors_reader import SafetensorsReader  # noqa: E402
from areal_npu.train.megatron import convert  # noqa: E402
from areal_npu.train.megatron.shape import gpt_shape  # noqa: E402
from areal_npu.train.megatron.stream import rank_tensors  # noqa: E402

MiB = 1 << 20


def _full(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _checkpoint(tmp_path, config, dtype=torch.float32, shard_bytes=1 << 14):
    from areal_npu.testing.load_memory import write_checkpoint

    write_checkpoint(tmp_path, config, shard_bytes=shard_bytes, dtype=dtype)
    return tmp_path


def test_the_reader_reads_every_tensor_and_every_row_and_column_range_exactly(tmp_path):
    from areal_npu.testing.load_memory import dense_config

    cfg = dense_config(layers=1, hidden=64, ffn=96, vocab=320)
    model_dir = _checkpoint(tmp_path, cfg, dtype=torch.bfloat16)
    full = _full(model_dir)
    reader = SafetensorsReader(model_dir, block_bytes=300)  # a column read spans several blocks
    assert len(list(model_dir.glob("*.safetensors"))) > 3 and sorted(reader.names()) == sorted(full)
    for name, t in full.items():
        assert reader.dtype(name) == t.dtype and reader.shape(name) == tuple(t.shape)
        assert torch.equal(reader.read(name), t)
        assert torch.equal(reader.read(name, slice(1, 5)), t[1:5])
        if t.dim() == 2:
            assert torch.equal(reader.read(name, slice(2, None), slice(3, 17)), t[2:, 3:17])


def _tiny_hybrid():
    from areal_npu.model.tiny import TinyModelConfig, hf_config
    from tests.support.megatron_tiny import TINY_QWEN35

    return hf_config(TinyModelConfig(**TINY_QWEN35))


@pytest.mark.parametrize("kind", ["dense", "dense_kv1", "hybrid"])
def test_each_rank_and_stage_reads_what_the_full_tensors_cut_give(tmp_path, kind):
    from areal_npu.testing.load_memory import dense_config

    if kind == "hybrid":
        cfg = _tiny_hybrid()
    else:  # kv1: one KV head, so a TP slice of the fused QKV cuts through its group
        cfg = dense_config(layers=2, hidden=64, ffn=96, vocab=320)
        cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim = (
            (1, 4, 16) if kind == "dense_kv1" else (2, 4, 16)
        )
    model_dir = _checkpoint(tmp_path, cfg)
    shape, full, reader = gpt_shape(cfg), _full(model_dir), SafetensorsReader(model_dir)
    tps = (1, 2) if kind == "hybrid" else (1, 2, 4)
    for tp in tps:
        for stage in (convert.ALL, convert.Stage(0, 2), convert.Stage(1, 2)):
            for rank in range(tp):
                want = convert.hf_to_mcore(full, shape, rank, tp, stage)
                got = dict(rank_tensors(reader, shape, rank, tp, stage))
                assert sorted(got) == sorted(want), (tp, stage)
                for name in want:
                    assert torch.equal(got[name], want[name]), (name, tp, rank, stage)
    # by hand: TP rank 1 of 2 holds the second half of the vocabulary and of o_proj's columns
    got = dict(rank_tensors(reader, shape, 1, 2))
    vocab = full["model.embed_tokens.weight"]
    assert torch.equal(got["embedding.word_embeddings.weight"], vocab[vocab.shape[0] // 2 :])
    if kind != "hybrid":
        o = full["model.layers.1.self_attn.o_proj.weight"]
        assert torch.equal(got["decoder.layers.1.self_attention.linear_proj.weight"], o[:, o.shape[1] // 2 :])


def test_a_checkpoint_with_an_unknown_or_missing_tensor_is_refused(tmp_path):
    from safetensors.torch import save_file

    from areal_npu.testing.load_memory import dense_config

    cfg = dense_config(layers=1, hidden=64, ffn=96, vocab=320)
    model_dir = _checkpoint(tmp_path, cfg)
    shape = gpt_shape(cfg)
    save_file({"model.layers.7.mlp.extra": torch.zeros(2)}, str(model_dir / "extra.safetensors"))
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.7.mlp.extra"] = "extra.safetensors"
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match="no Megatron counterpart"):
        list(rank_tensors(SafetensorsReader(model_dir), shape))
    del index["weight_map"]["model.norm.weight"]
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    shard = next(p for p in model_dir.glob("model-*.safetensors") if "model.norm.weight" in _keys(p))
    save_file({k: v for k, v in _full_file(shard).items() if k != "model.norm.weight"}, str(shard))
    with pytest.raises(KeyError, match="lacks"):
        list(rank_tensors(SafetensorsReader(model_dir), shape, skip=lambda n: "extra" in n))


def _keys(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def _full_file(path):
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("disk,model", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_a_model_loads_a_checkpoint_of_another_dtype_and_keeps_the_exact_values(tmp_path, disk, model):
    """bf16 on disk into fp32 parameters (cast), and fp32 into bf16 parameters: then the fp32 values
    come back for the optimizer's masters."""
    from areal_npu.testing.load_memory import dense_config
    from areal_npu.train.dist import init_distributed
    from areal_npu.train.megatron.model import build_gpt_model
    from areal_npu.train.megatron.runtime import init_parallel_state
    from areal_npu.train.megatron.stream import load_rank_weights

    init_distributed()
    init_parallel_state(1)
    cfg = dense_config(layers=2, hidden=64, ffn=96, vocab=320)
    cfg.num_attention_heads, cfg.head_dim = 4, 16
    model_dir = _checkpoint(tmp_path, cfg, dtype=disk)
    shape, full = gpt_shape(cfg), _full(model_dir)
    module = build_gpt_model(cfg, dtype=model, device="cpu")
    exact = load_rank_weights(module, SafetensorsReader(model_dir), shape, 0, 1)
    want = convert.hf_to_mcore(full, shape)
    held = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    assert sorted(held) == sorted(want)
    for name, t in want.items():
        assert held[name].dtype == model and torch.equal(held[name], t.to(model)), name
    assert sorted(exact) == (sorted(want) if disk == torch.float32 else [])
    for name, t in exact.items():
        assert t.dtype == torch.float32 and torch.equal(t, want[name]), name


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["stream", "fsdp2-stream"])
def test_two_ranks_each_hold_only_their_half_while_loading(tmp_path, mode):
    """Megatron (TP=2) and FSDP2 (2 shards) engines' loads, each rank a fresh process."""
    from areal_npu.testing.load_memory import dense_config, measure_rank, write_checkpoint
    from tests.support.ranks import start_processes

    cfg = dense_config(layers=4)
    size = write_checkpoint(tmp_path / "ckpt", cfg, shard_bytes=64 * MiB)
    assert len(list((tmp_path / "ckpt").glob("*.safetensors"))) >= 4 and size > 200 * MiB
    out = str(tmp_path / "rank")
    args = (2, str(tmp_path / "ckpt"), str(tmp_path / "rdv"), out, mode, True)
    start_processes(measure_rank, args=args, nprocs=2, join=True)
    full, shape = _full(tmp_path / "ckpt"), gpt_shape(cfg)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank.{rank}.json").read_text())
        growth = result["peak"] - result["rss_before"]
        assert result["held"] >= 0.45 * size  # it does hold its half
        assert growth <= 0.6 * size + 64 * MiB, (growth / MiB, size / MiB)
        held = torch.load(f"{out}.{rank}.pt")
        if mode == "stream":
            want = convert.hf_to_mcore(full, shape, rank, 2)
        else:  # FSDP2's Shard(0): torch.chunk's rows of every HF tensor
            want = {"lm." + n: t.chunk(2)[rank] for n, t in full.items()}
        assert sorted(held) == sorted(want)
        for name, t in want.items():
            assert torch.equal(held[name], t), name
