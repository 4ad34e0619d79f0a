"""The FSDP2 engine's HF export is written in the dtype the checkpoint declares. A published Qwen3.5
checkpoint (vision tower, ``mtp.*``) whose ``config.json`` says ``bfloat16`` (as Qwen3.5/3.6 ship)
is loaded into fp32 masters and exported into several shards: every floating tensor in the
safetensors headers (read by the safetensors library) is BF16 and equals the fp32 master rounded by
torch's own ``.to(torch.bfloat16)``, the carried vision tower likewise; the index counts 2 bytes an
element, the saved config declares bfloat16 (outer and text config) while the live one is left as
training built it, and the engine loads the export back (fp32 masters = the bf16 values).
One rank, in process."""

import json

import torch
from safetensors import safe_open

from areal_npu.train.dist import init_distributed

LIMIT = 256 * 1024


def _bf16_published(tmp_path):
    from areal_npu.model.tiny import TinyModelConfig, save_tiny_model

    src = save_tiny_model(tmp_path / "src", TinyModelConfig(num_hidden_layers=2, linear_attention_every=2))
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = config["text_config"]["dtype"] = "bfloat16"
    (src / "config.json").write_text(json.dumps(config))
    return src


def _read(out_dir) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    dtypes, tensors = {}, {}
    for path in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                dtypes[name] = f.get_slice(name).get_dtype()
                tensors[name] = f.get_tensor(name)
    return dtypes, tensors


def test_a_bf16_checkpoint_is_exported_in_bf16_from_the_fp32_masters(tmp_path):
    from areal_npu.model.layout import VISION_PREFIX, read_checkpoint_tensors
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.fsdp2 import FSDPEngine
    from areal_npu.train.fsdp2_checkpoint import write_hf_checkpoint

    init_distributed()
    src = _bf16_published(tmp_path)
    mtp = MTPConfig(enabled=True, train=True)
    engine = FSDPEngine.from_checkpoint(src, TrainEngineConfig(), mtp, pad_token_id=0)
    masters = {}
    for name, p in engine.module.named_parameters():
        full = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        assert full.dtype == torch.float32, name
        if name.startswith("lm."):
            masters[engine.layout.checkpoint_name(name[len("lm.") :])] = full
        elif name.startswith("mtp."):
            masters[name] = full
    vision = read_checkpoint_tensors(src, keep=lambda n: n.startswith(VISION_PREFIX))
    assert vision and any(n.startswith("mtp.") for n in masters)

    out = write_hf_checkpoint(engine, tmp_path / "export", max_shard_bytes=LIMIT)
    dtypes, written = _read(out)
    assert sorted(written) == sorted({**masters, **vision})
    assert set(dtypes.values()) == {"BF16"}
    rounded = 0
    for name, master in {**masters, **vision}.items():
        want = master.to(torch.bfloat16)
        assert torch.equal(written[name], want), name
        rounded += int(not torch.equal(want.float(), master))
    assert rounded > len(masters) // 2  # the masters are not bf16 values already: rounding happened

    files = sorted(out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(files) > 2 and all(f.stat().st_size <= LIMIT + 64 * 1024 for f in files)
    assert index["metadata"]["total_size"] == 2 * sum(t.numel() for t in written.values())
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["text_config"]["dtype"] == "bfloat16"
    assert engine.lm.config.dtype == torch.float32  # the live config: what the model was built in

    again = FSDPEngine.from_checkpoint(out, TrainEngineConfig(), mtp, pad_token_id=0)
    for name, p in again.module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        key = again.layout.checkpoint_name(name[len("lm.") :]) if name.startswith("lm.") else name
        assert full.dtype == torch.float32 and torch.equal(full.cpu(), written[key].float()), name
