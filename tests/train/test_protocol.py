"""The train-engine interface (:class:`areal_npu.train.protocol.TrainEngine`): both engines have
every member with the Protocol's parameters, and the callers use nothing else: the controller's
training path runs against a recording fake that *is* the Protocol and nothing more, and the
warm start / ``run.py`` touch no other engine attribute (read from their source)."""

import ast
import asyncio
import inspect
from pathlib import Path

import pytest
import torch

from areal_npu import names as N
from areal_npu.algo.advantages import GRPOConfig
from areal_npu.config import ConfigError
from areal_npu.controller import ControllerConfig, RLController
from areal_npu.data.buckets import DEFAULT_BUCKET_BYTES
from areal_npu.data.sample import TrainSample
from areal_npu.data.trajectory import Trajectory
from areal_npu.speculation.config import SpecConfig
from areal_npu.train.losses import PPOLoss, SFTLoss
from areal_npu.train.protocol import TrainEngine

ROOT = Path(__file__).resolve().parents[2]
METHODS = sorted(
    name
    for name, value in vars(TrainEngine).items()
    if inspect.isfunction(value) and not name.startswith("_")
)
DATA = sorted(TrainEngine.__annotations__)
MEMBERS = set(METHODS) | set(DATA)


def _engine_classes():
    from areal_npu.train.fsdp2 import FSDPEngine
    from areal_npu.train.megatron.engine import MegatronEngine  # imports no Megatron at import time

    return [FSDPEngine, MegatronEngine]


def test_the_protocol_is_the_documented_interface():
    assert set(METHODS) == {
        "compute_logprobs", "forward_backward", "optimizer_step", "train_step", "full_state_dict",
        "export_buckets", "save_checkpoint", "load_checkpoint", "save_hf_checkpoint",
    }  # fmt: skip
    assert DATA == ["mtp", "version"]


@pytest.mark.parametrize("engine_class", _engine_classes(), ids=lambda c: c.__name__)
def test_both_engines_have_every_member_with_the_protocols_parameters(engine_class):
    for name in METHODS:
        want = list(inspect.signature(getattr(TrainEngine, name)).parameters)
        got = list(inspect.signature(getattr(engine_class, name)).parameters)
        assert got == want, f"{engine_class.__name__}.{name}{got} != {want}"
    init = inspect.getsource(engine_class.__init__)
    for name in DATA:  # instance attributes, set by the constructor
        assert f"self.{name} = " in init or f"self.{name}, " in init or f", self.{name} = " in init, name


def test_an_fsdp2_engine_is_a_train_engine():
    from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, build_tiny_model
    from areal_npu.train.config import TrainEngineConfig
    from areal_npu.train.dist import init_distributed
    from areal_npu.train.fsdp2 import FSDPEngine

    init_distributed()
    lm, _, _ = build_tiny_model(
        TinyModelConfig(**TEXT_FULL_ATTENTION, hidden_size=32, intermediate_size=32, head_dim=8)
    )
    assert isinstance(FSDPEngine(lm, None, TrainEngineConfig()), TrainEngine)


# ---- the callers ------------------------------------------------------------------------------


class RecordingEngine:
    """Exactly the Protocol: every call is recorded; any other attribute does not exist."""

    def __init__(self):
        self.version = 0
        self.mtp = None
        self.calls: list[tuple] = []

    def compute_logprobs(self, samples):
        self.calls.append(("compute_logprobs", len(samples)))
        return [torch.full((len(s),), -1.0) for s in samples]

    def forward_backward(self, samples, loss, step=None):
        raise AssertionError("the controller trains through train_step")

    def optimizer_step(self, step=None, bump_version=True):
        raise AssertionError("the controller trains through train_step")

    def train_step(self, samples, loss, step=None):
        assert all(isinstance(s, TrainSample) and s.prox_logp is not None for s in samples)
        self.calls.append(("train_step", len(samples), loss, step))
        self.version += 1
        return {N.PPO_LOSS: 0.0, N.TRAIN_VERSION: float(self.version)}

    def full_state_dict(self):
        raise AssertionError("the controller pushes weights through export_buckets")

    def export_buckets(self, bucket_bytes=DEFAULT_BUCKET_BYTES, kinds=("policy", "mtp")):
        self.calls.append(("export_buckets", bucket_bytes))
        yield "policy", [("model.norm.weight", torch.ones(2))]

    def save_checkpoint(self, root, extra=None, tokenizer=None, keep_last=2):
        self.calls.append(("save_checkpoint", Path(root).name, extra))
        return Path(root) / f"step_{self.version}"

    def load_checkpoint(self, path):
        raise AssertionError("not the controller's")

    def save_hf_checkpoint(self, out_dir, tokenizer=None):
        raise AssertionError("not the controller's")


class OnlyTheProtocol:
    """Forwards Protocol members to ``inner``; touching anything else fails the test."""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name):
        if name not in MEMBERS:
            raise AssertionError(f"the caller used engine.{name}, which is not in the TrainEngine Protocol")
        return getattr(object.__getattribute__(self, "_inner"), name)


class Client:
    def __init__(self):
        self.pushed = []
        self.generation = [0]  # restarts per engine (RolloutClient's)

    async def step_metrics(self):
        return {}

    async def update_weights(self, named, version, sync_draft=True, engines=None):
        self.pushed.append((version, [n for n, _ in named]))
        return {}


class Workflow:
    async def run(self, task, client, group_id):
        return [
            Trajectory([1, 2], [3, 4, 5], [-0.5] * 3, [0] * 3, reward=float(i), group_id=group_id)
            for i in range(2)
        ]


class Logger:
    def log(self, step, stats):
        pass

    def print(self, *args):
        pass


def test_the_controllers_training_path_uses_only_the_protocol(tmp_path):
    engine, client = RecordingEngine(), Client()
    loss = PPOLoss()
    controller = RLController(
        ControllerConfig(steps=2, batch_groups=2, checkpoint_every=1), OnlyTheProtocol(engine), None, client,
        list(range(8)), tmp_path, Logger(), spec=SpecConfig(), grpo=GRPOConfig(), loss=loss, seed=0,
    )  # fmt: skip
    history = asyncio.run(controller.run(Workflow()))
    assert len(history) == 2
    kinds = [c[0] for c in engine.calls]
    assert kinds == ["compute_logprobs", "train_step", "export_buckets", "save_checkpoint"] * 2
    trains = [c for c in engine.calls if c[0] == "train_step"]
    assert [(n, step) for _, n, _, step in trains] == [(4, 0), (4, 1)] and all(c[2] is loss for c in trains)
    assert [v for v, _ in client.pushed] == [1, 2]
    assert [c[2] for c in engine.calls if c[0] == "save_checkpoint"] == [{"step": 0}, {"step": 1}]


def _engine_attributes(path: Path, names: tuple[str, ...]) -> set[str]:
    """Attributes read from ``engine`` / ``self.engine`` in a module's source."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id in names) or (
            isinstance(base, ast.Attribute) and base.attr in names
        ):
            found.add(node.attr)
    return found


@pytest.mark.parametrize("module", ["areal_npu/controller.py", "areal_npu/run.py", "areal_npu/warmstart.py"])
def test_callers_touch_only_protocol_members(module):
    used = _engine_attributes(ROOT / module, ("engine",))
    assert used, f"no engine use found in {module}: the check reads nothing"
    assert used <= MEMBERS, f"{module} uses {sorted(used - MEMBERS)} beyond the TrainEngine Protocol"


def test_losses_declare_what_context_parallelism_needs():
    from areal_npu.algo.ppo import PPOConfig

    assert not SFTLoss().needs_whole_sequences and not PPOLoss().needs_whole_sequences
    assert PPOLoss(PPOConfig(loss_agg="seq-mean")).needs_whole_sequences
    sequence_cap = PPOConfig(
        behave_imp_weight_mode="clamp", behave_imp_weight_cap=2.0, behave_imp_weight_level="sequence"
    )
    assert PPOLoss(sequence_cap).needs_whole_sequences
    # a sequence level without outlier control would use the raw per-token weight: refused as ignored
    with pytest.raises(ConfigError, match="ppo.behave_imp_weight_level"):
        PPOLoss(PPOConfig(behave_imp_weight_level="sequence"))


def test_ppo_loss_checks_its_inputs_and_drops_non_finite_samples_when_asked():
    from areal_npu.algo.guard import NonFiniteError
    from areal_npu.algo.ppo import PPOConfig

    def sample(behave):
        n = len(behave)
        return TrainSample(
            input_ids=torch.arange(n), loss_mask=torch.ones(n, dtype=torch.bool),
            behave_logp=torch.tensor(behave), versions=torch.zeros(n, dtype=torch.long),
            advantage=torch.tensor(1.0), prox_logp=torch.full((n,), -1.0),
        )  # fmt: skip

    good, bad = sample([-1.0, -2.0]), sample([-1.0, float("nan")])
    with pytest.raises(NonFiniteError, match="behave_logp"):
        PPOLoss().check([good, bad], step=3)
    kept = PPOLoss(PPOConfig(on_nonfinite="drop")).check([good, bad], step=3)
    assert len(kept) == 1 and kept[0] is good
    with pytest.raises(ValueError, match="no prox_logp"):
        PPOLoss().check([TrainSample(input_ids=torch.arange(2), loss_mask=torch.ones(2, dtype=torch.bool),
                                     behave_logp=torch.zeros(2), versions=torch.zeros(2, dtype=torch.long),
                                     advantage=torch.tensor(0.0))], step=0)  # fmt: skip
