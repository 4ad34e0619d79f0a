"""Peak host memory of one rank loading its Megatron shards (``scripts/bench_load_memory.py``, the
load-memory test): a generated checkpoint in the published shape (several safetensors files and
``model.safetensors.index.json``) and the per-rank measurement, run in a fresh process per rank.

``stream``: the engine's path (:mod:`areal_npu.train.megatron.stream`: an uninitialised model,
this rank's rows / columns read into it). ``full``: what a rank did before -- transformers loads
the whole model, then the rank keeps its shards.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

__all__ = ["dense_config", "measure_rank", "write_checkpoint"]


def dense_config(layers: int = 4, hidden: int = 1024, ffn: int = 2816, vocab: int = 8192):
    """A Qwen3 (dense) config: 8 query heads, 4 KV heads of 128 (``layers=4``: ~250 MB in fp32)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=4096,
        tie_word_embeddings=False, rope_parameters={"rope_theta": 1_000_000.0, "rope_type": "default"},
    )  # fmt: skip


def write_checkpoint(out_dir, config, shard_bytes: int = 64 << 20, dtype=torch.float32, seed: int = 0) -> int:
    """Random weights for every tensor of ``config``'s model, written one shard (at most
    ``shard_bytes``, one tensor at least) at a time, with the index and ``config.json``. Returns
    the bytes of tensor data."""
    from safetensors.torch import save_file

    from areal_npu.train.megatron.convert import hf_names, hf_shape
    from areal_npu.train.megatron.shape import gpt_shape

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shape = gpt_shape(config)
    g = torch.Generator().manual_seed(seed)
    shards, current, size, total = [], {}, 0, 0

    def flush():
        nonlocal current, size
        if current:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(current, str(out / name), metadata={"format": "pt"})
            shards.append((name, list(current)))
            current, size = {}, 0

    for name in hf_names(shape):
        t = (torch.randn(hf_shape(name, shape), generator=g) * 0.02).to(dtype)
        if current and size + t.nbytes > shard_bytes:
            flush()
        current[name] = t
        size += t.nbytes
        total += t.nbytes
    flush()
    count = len(shards)
    weight_map = {}
    for i, (name, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        (out / name).rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(out)
    return total


def _megatron(mode: str, model_dir: str, rank: int, world: int):
    from transformers import AutoConfig

    from areal_npu.model.safetensors_reader import SafetensorsReader
    from areal_npu.train.megatron.model import build_gpt_model
    from areal_npu.train.megatron.shape import gpt_shape
    from areal_npu.train.megatron.stream import StateSource, load_rank_weights

    config = AutoConfig.from_pretrained(model_dir)
    shape = gpt_shape(config)
    module = build_gpt_model(config, tp_size=world, device="cpu")
    if mode == "stream":
        load_rank_weights(module, SafetensorsReader(model_dir), shape, rank, world)
    else:
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        load_rank_weights(module, StateSource(lm.state_dict()), shape, rank, world)
        del lm
    tensors = {k: v for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    return module, tensors


def _fsdp2(mode: str, model_dir: str):
    from areal_npu.model.layout import load_for_training
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.fsdp2 import FSDPEngine

    off = MTPConfig(enabled=False)
    if mode == "fsdp2-stream":
        engine = FSDPEngine.from_checkpoint(model_dir, TrainEngineConfig(), off)
    else:
        lm, _, layout = load_for_training(model_dir, off)
        engine = FSDPEngine(lm, None, TrainEngineConfig(), off, layout=layout)
        del lm
    return engine, {n: p.to_local() for n, p in engine.module.named_parameters()}


def _preload(model_dir: str) -> None:
    """Import what a load imports (the engines, Megatron's GPT model, the config's transformers model)."""
    import importlib

    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    for name in ("areal_npu.train.fsdp2", "areal_npu.train.megatron.model", "megatron.core.models.gpt"):
        importlib.import_module(name)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_dir))]


def measure_rank(
    rank: int, world: int, model_dir: str, init_file: str, out: str, mode: str, keep: bool
) -> None:
    """One of ``world`` ranks loads its shards of ``model_dir`` -- Megatron (``stream`` / ``full``,
    TP = world) or FSDP2 (``fsdp2-stream`` / ``fsdp2-full``, the engine, sharded over world); writes
    ``{out}.{rank}.json`` (RSS before, peak, seconds, bytes held) and, with ``keep``, its tensors to
    ``{out}.{rank}.pt``. Peak: ``VmHWM`` after the load, reset to the resident size just before."""
    from areal_npu.testing.memory import reset_peak_rss, status_bytes
    from areal_npu.train.dist import process_group
    from areal_npu.train.megatron.runtime import init_parallel_state

    with process_group(rank, world, f"file://{init_file}"):
        if not mode.startswith("fsdp2"):
            init_parallel_state(world)
        _preload(model_dir)  # imports are not loading: done before the peak is reset
        torch.distributed.barrier()
        reset_peak_rss()
        before, start = status_bytes("VmRSS"), time.perf_counter()
        if mode.startswith("fsdp2"):
            owner, tensors = _fsdp2(mode, model_dir)
        else:
            owner, tensors = _megatron(mode, model_dir, rank, world)
        seconds = time.perf_counter() - start
        peak = status_bytes("VmHWM")
        held = sum(t.nbytes for t in tensors.values())
        result = {
            "rank": rank,
            "mode": mode,
            "rss_before": before,
            "peak": peak,
            "held": held,
            "seconds": seconds,
        }
        Path(f"{out}.{rank}.json").write_text(json.dumps(result))
        if keep:
            torch.save(tensors, f"{out}.{rank}.pt")
        del owner
        torch.distributed.barrier()
