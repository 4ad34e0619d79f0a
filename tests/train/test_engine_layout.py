"""The FSDP2 engine on a checkpoint in the published (multimodal) Qwen3.5 layout.

References: the same weights in the text-only layout, converted by hand below (a packed step must
give identical log-probs, stats and gradients); transformers' ``Qwen3_5ForConditionalGeneration``
run per sequence, unpacked (log-probs); transformers' VL state-dict keys (export and checkpoint
names); the source checkpoint's own bytes (the vision tower is carried through untouched).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from areal_npu import names as N
from areal_npu.data.packing import PackingConfig
from areal_npu.data.sample import TrainSample
from areal_npu.model.layout import load_for_training
from areal_npu.model.mtp import MTPConfig
from areal_npu.model.tiny import TinyModelConfig, save_tiny_model
from areal_npu.train.config import TrainEngineConfig
from areal_npu.train.dist import init_distributed
from areal_npu.train.fsdp2 import FSDPEngine
from areal_npu.train.losses import SFTLoss
from areal_npu.train.optim import OptimConfig

# 3 Gated DeltaNet + 1 full attention, like each quarter of Qwen3.6-27B; one MTP layer
PUBLISHED_TINY = TinyModelConfig(
    layout="published",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_attention_every=4,
    linear_head_dim=16,
    seed=11,
)
MTP_ON = MTPConfig(enabled=True, train=True)
QUICKSTART = Path(__file__).resolve().parents[2] / "recipes" / "cpu" / "quickstart.yaml"


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    init_distributed()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(published checkpoint, the same weights in the text layout, converted by hand)."""
    root = tmp_path_factory.mktemp("layouts")
    published = save_tiny_model(root / "published", PUBLISHED_TINY)
    outer = json.loads((published / "config.json").read_text())
    text_config = dict(outer["text_config"], architectures=["Qwen3_5ForCausalLM"])
    text = root / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps(text_config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (text / name).write_bytes((published / name).read_bytes())
    renamed = {}
    with safe_open(str(published / "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.startswith("model.visual."):
                continue
            renamed[key.replace("model.language_model.", "model.", 1)] = f.get_tensor(key)
    save_file(renamed, str(text / "model.safetensors"))
    return published, text


def samples(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = 4 + i, 5 + 3 * i
        ids = torch.randint(0, 256, (p + r,), generator=g)
        mask = torch.zeros(p + r, dtype=torch.bool)
        mask[p:] = True
        out.append(TrainSample(input_ids=ids, loss_mask=mask))
    return out


def engine_for(path, cap=40):
    lm, head, layout = load_for_training(path, MTP_ON)
    cfg = TrainEngineConfig(
        packing=PackingConfig(max_tokens_per_mb=cap), optim=OptimConfig(lr=1e-2, grad_clip=0.0)
    )
    return FSDPEngine(lm, head, cfg, mtp_config=MTP_ON, layout=layout)


def grads(engine):
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in engine.module.named_parameters()
        if p.grad is not None
    }


def stored(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_packed_step_equals_the_text_layout_and_the_unpacked_vl_model(checkpoints):
    from transformers import Qwen3_5ForConditionalGeneration

    published, text = checkpoints
    batch = samples()
    a, b = engine_for(published), engine_for(text)
    logp_a, logp_b = a.compute_logprobs(batch), b.compute_logprobs(batch)
    for x, y in zip(logp_a, logp_b):
        assert torch.equal(x, y)
    # packed (GDN state reset per segment) against the VL class run on each sequence alone
    vl = Qwen3_5ForConditionalGeneration.from_pretrained(published, dtype=torch.float64).eval()
    for s, got in zip(batch, logp_a):
        ids = s.input_ids
        with torch.no_grad():
            logits = vl(input_ids=ids[None]).logits[0]
        want = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
        torch.testing.assert_close(got[1:].double(), want, rtol=0, atol=2e-5)

    stats_a = a.forward_backward(batch, SFTLoss())
    stats_b = b.forward_backward(batch, SFTLoss())
    assert stats_a == stats_b
    assert stats_a[N.mtp_count_key(1)] > 0
    ga, gb = grads(a), grads(b)
    assert sorted(ga) == sorted(gb) and any(n.startswith("mtp.") for n in ga)
    for name in ga:
        assert torch.equal(ga[name], gb[name]), name


def test_export_names_are_the_published_ones_and_vision_only_when_asked(checkpoints):
    from transformers import AutoConfig, Qwen3_5ForConditionalGeneration

    published, _ = checkpoints
    engine = engine_for(published)
    vl_keys = set(Qwen3_5ForConditionalGeneration(AutoConfig.from_pretrained(published)).state_dict())
    text_keys = {k for k in vl_keys if not k.startswith("model.visual.")}
    drafting = {"mtp." + n for n, _ in engine.mtp.named_drafting_parameters()}
    exported = {k: [n for n, _ in b] for k, b in engine.export_buckets(bucket_bytes=20_000)}
    names = [n for _, b in engine.export_buckets(bucket_bytes=20_000) for n, _ in b]
    assert set(names) == text_keys | drafting and len(names) == len(set(names))
    assert set(exported) == {"policy", "mtp"}
    source = stored(published)
    vision = [(n, t) for _, b in engine.export_buckets(kinds=("vision",)) for n, t in b]
    assert sorted(n for n, _ in vision) == sorted(k for k in vl_keys if k.startswith("model.visual."))
    for name, tensor in vision:
        assert torch.equal(tensor, source[name])
    with pytest.raises(ValueError, match="unknown export kinds"):
        list(engine.export_buckets(kinds=("visual",)))


def test_checkpoint_keeps_the_layout_and_resumes(checkpoints, tmp_path):
    from transformers import Qwen3_5ForConditionalGeneration

    published, _ = checkpoints
    engine = engine_for(published)
    engine.train_step(samples(), SFTLoss())
    path = engine.save_checkpoint(tmp_path / "ckpts")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    assert (path / "preprocessor_config.json").is_file()
    saved, source = stored(path), stored(published)
    assert sorted(saved) == sorted(source)
    trained = dict(engine.full_state_dict())
    changed = 0
    for name, tensor in saved.items():
        if name.startswith("model.visual."):
            assert torch.equal(tensor, source[name]), name  # frozen, untouched
        else:
            key = name.replace("model.language_model.", "model.", 1)
            assert torch.equal(tensor, trained[key]), name
            changed += not torch.equal(tensor, source[name])
    assert changed > 0
    _, info = Qwen3_5ForConditionalGeneration.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"]

    resumed = engine_for(path)
    resumed.load_checkpoint(path)
    assert resumed.version == engine.version == 1
    for (n1, t1), (n2, t2) in zip(engine.full_state_dict(), resumed.full_state_dict()):
        assert n1 == n2 and torch.equal(t1, t2)
    batch = samples(seed=3)
    assert engine.train_step(batch, SFTLoss()) == resumed.train_step(batch, SFTLoss())


def test_warm_start_writes_the_published_layout_back(checkpoints, tmp_path):
    from rich.console import Console

    from areal_npu.agent.tasks import make_splits
    from areal_npu.config import load_config
    from areal_npu.recipe import RLConfig
    from areal_npu.warmstart import warm_start

    published, _ = checkpoints
    cfg = load_config(RLConfig, QUICKSTART, ["warmstart.steps=2", "warmstart.batch_size=4", "task.n_train=8"])
    out = warm_start(
        published, make_splits(cfg.task)[0], tmp_path / "warm", Console(quiet=True),
        cfg=cfg.warmstart, train=cfg.train, mtp=cfg.mtp, seed=cfg.seed,
    )  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in config
    saved, source = stored(out), stored(published)
    assert sorted(saved) == sorted(source)
    assert all(torch.equal(saved[n], source[n]) for n in saved if n.startswith("model.visual."))
    assert any(not torch.equal(saved[n], source[n]) for n in saved if n.startswith("model.language_model."))
