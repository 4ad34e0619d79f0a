"""The EAGLE-3 drafter on vLLM-Ascend 0.23's path: recording fakes of its runner and proposer, checked
against vLLM's own ``Eagle3LlamaForCausalLM`` (built tiny on the CPU from our drafter's config).

What the fakes copy from vLLM-Ascend (``releases/v0.23.0`` at eaefc536d4, ``docker/versions.env``):

* ``worker/model_runner_v1.py:617-650``: the runner keeps the proposer as ``drafter``
  (``spec_decode/__init__.py:43-47``: ``AscendEagleProposer`` for ``eagle3``); ``:3692``
  ``drafter.load_model(self.model)``. ``worker/worker.py:804-805``: ``NPUWorker.get_model()`` is the
  runner's; the worker has no ``get_draft_model`` (vLLM 0.23 neither).
* ``spec_decode/llm_base_proposer.py:317-373`` (``load_model``): the drafter is vLLM's
  ``Eagle3LlamaForCausalLM`` from ``get_model``, built by Ascend's ``__init__``
  (``patch/worker/patch_eagle3_init.py:59-81``: its own ``ParallelLMHead(draft_vocab_size)``, a zero
  ``draft_id_to_target_id``); ``:386-451``: the target's ``embed_tokens`` replaces the drafter's when
  the checkpoint had none; ``:454-491``: the output head is shared only for ``eagle`` / ``dflash``,
  so an ``eagle3`` drafter keeps its own, which our checkpoint (no ``lm_head``) never loads;
  ``:493-504``: with FULL graphs ``_runnable`` becomes an ``ACLGraphWrapper`` of the draft step
  while ``model`` stays the raw module; ``:525-529``: ``get_model`` unwraps.
* Names: vLLM 0.23's ``Eagle3LlamaForCausalLM.load_weights`` (``llama_eagle3.py:400-450``) prefixes
  ``model.`` (except ``lm_head``/``d2t``), its ``LlamaModel.load_weights`` (``:256-288``) maps
  ``midlayer.`` to ``layers.0.`` and q/k/v, gate/up into the fused ``qkv_proj``/``gate_up_proj``, and
  looks every other name up in its parameters (``KeyError`` for anything else).

The fakes fail on what the real stack would reject or silently get wrong: a name the drafter does not
have, a name that lands in a module the drafter shares with the target (loading the target from the
drafter's session), a tensor a captured graph reads being replaced, a capture during the update.
The reference (:func:`test_our_export_is_what_vllms_eagle3_loads`): vLLM's real model loads the
names we send, fills exactly the parameters the fake maps them to, and, with vLLM's own proposer's
sharing step, ends with the target's head, which :func:`tie_draft_head` reproduces on Ascend's path.
"""

from __future__ import annotations

import contextlib
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")
import vllm.distributed.parallel_state as parallel_state  # noqa: E402
import vllm.model_executor.models.registry as model_registry  # noqa: E402
from vllm.config import (  # noqa: E402
    CUDAGraphMode,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading  # noqa: E402
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM  # noqa: E402

from areal_npu.model.eagle3 import Eagle3Config, Eagle3Drafter, save_eagle3_drafter  # noqa: E402
from areal_npu.names import EAGLE3_PREFIX  # noqa: E402
from areal_npu.rollout import inplace_reload  # noqa: E402
from areal_npu.rollout.buckets import pack_bucket  # noqa: E402
from areal_npu.rollout.inplace_reload import InPlaceReloadMixin, tie_draft_head  # noqa: E402
from areal_npu.rollout.weight_stream import iter_target_buckets  # noqa: E402

HOST_COPIES = ("._k_scale_cpu", "._v_scale_cpu")
VOCAB, H = 100, 32  # ParallelLMHead pads the vocabulary to 128 rows: both heads alike


class Recapture(AssertionError):
    """A graph was captured during the update."""


class UnknownWeight(AssertionError):
    """A name vLLM's Eagle3 loader would not find among the drafter's parameters."""


class LoadedIntoTarget(AssertionError):
    """A drafter-session name that lands in a module the drafter shares with the target."""


class Kept(QuantizeMethodBase):
    """vLLM-Ascend's unquantized methods with NZ off keep the loaded tensor (``ops/linear.py:86-98``;
    CPU vLLM would repack it, which Ascend does not)."""

    def create_weights(self, *args, **kwargs):
        pass

    def apply(self, layer, x, bias=None):
        return x @ layer.weight.T

    def process_weights_after_loading(self, layer):
        pass


FUSED = ((".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
         (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1))  # fmt: skip


def vllm_param_name(name: str) -> tuple[str, object]:
    """Where vLLM 0.23's Eagle3 loader puts a checkpoint name (module docstring), and the shard."""
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id"), None
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for shard, fused, shard_id in FUSED:
        if shard in name:
            return name.replace(shard, fused), shard_id
    return name, None


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Our drafter (trainer side), and the vLLM config of a target with its checkpoint layout."""
    from transformers import Qwen3Config

    root = tmp_path_factory.mktemp("eagle3_ascend")
    policy = Qwen3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    policy.save_pretrained(root / "policy")
    ours = Eagle3Drafter.for_policy(policy, Eagle3Config(), torch.Generator().manual_seed(0))
    save_eagle3_drafter(ours, root / "drafter")
    return ours, root


def vllm_config(root: Path) -> VllmConfig:
    # vLLM inspects a model class in a subprocess (no CUDA init in the parent; ~20 s per class on a
    # cold cache, which the 0.23 and 0.32 runs keep evicting for each other): on the CPU, in process
    with mock.patch.object(model_registry, "_run_in_subprocess", lambda fn: fn()):
        target = ModelConfig(
            model=str(root / "policy"), skip_tokenizer_init=True, dtype="float32", max_model_len=128
        )
        spec = SpeculativeConfig(method="eagle3", model=str(root / "drafter"), num_speculative_tokens=1,
                                 target_model_config=target, target_parallel_config=ParallelConfig())  # fmt: skip
    config = VllmConfig(model_config=target, speculative_config=spec)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL  # graphs captured: moves are errors
    return config


@contextlib.contextmanager
def one_rank(config: VllmConfig):
    """vLLM's parallel layers without a process group: tensor and pipeline rank 0 of 1."""
    group = types.SimpleNamespace(
        world_size=1, rank_in_group=0, rank=0, is_first_rank=True, is_last_rank=True
    )
    with (
        mock.patch.object(parallel_state, "_TP", group),
        mock.patch.object(parallel_state, "_PP", group),
        set_current_vllm_config(config),
        torch.device("cpu"),
    ):
        yield


def build_drafter(config: VllmConfig) -> Eagle3LlamaForCausalLM:
    """vLLM's Eagle3 model as ``get_model`` builds it (parameters filled with NaN: never loaded)."""
    config.compilation_config.static_forward_context.clear()  # its attention layer registers by name
    with one_rank(config):
        model = Eagle3LlamaForCausalLM(vllm_config=config)
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))
    return model


def export(ours: Eagle3Drafter, scale: float = 1.0) -> list[tuple[str, torch.Tensor]]:
    """The trainer's export of the drafter (``eagle3.*``), as the weight stream sends it: the draft
    target's bucket names, prefix stripped (``rollout/weight_stream.py``)."""
    named = [(EAGLE3_PREFIX + n, p.detach() * scale) for n, p in ours.named_parameters()]
    return [
        pair for target, bucket in iter_target_buckets(named, 1 << 30) if target == "draft" for pair in bucket
    ]


def expected(sent: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """vLLM parameter -> value, computed from the sent tensors by hand (fused rows in shard order)."""
    parts: dict[str, list] = {}
    for name, tensor in sent:
        param, shard = vllm_param_name(name)
        parts.setdefault(param, []).append(
            (["q", "k", "v", 0, 1].index(shard) if shard is not None else 0, tensor)
        )
    return {p: torch.cat([t for _, t in sorted(ts, key=lambda x: x[0])]) for p, ts in parts.items()}


class Target(nn.Module):
    """The served policy as the proposer sees it: ``model.embed_tokens`` and ``lm_head`` (vLLM's layers)."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(VOCAB, H)
        self.lm_head = ParallelLMHead(VOCAB, H)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            params[name].weight_loader(params[name], tensor)


def policy_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(VOCAB, H, generator=g) for n in ("model.embed_tokens.weight", "lm_head.weight")}


def test_our_export_is_what_vllms_eagle3_loads(configs):
    """Reference: vLLM's real ``Eagle3LlamaForCausalLM`` takes every name we send, fills exactly the
    parameters the fake maps them to with the values computed by hand, and leaves the embedding and
    output head, which vLLM's own proposer then takes from the target: no-op for ``tie_draft_head``."""
    from vllm.v1.spec_decode.eagle import EagleProposer

    ours, root = configs
    config = vllm_config(root)
    real = build_drafter(config)
    sent = export(ours)
    assert {n for n, _ in sent} == {n for n, _ in ours.named_parameters()}  # no eagle3. prefix
    with one_rank(config), torch.no_grad():
        real.load_weights(iter(sent))
    want = expected(sent)
    params = dict(real.named_parameters())
    filled = {n for n, p in params.items() if p.is_floating_point() and not p.isnan().any()}
    assert filled == set(want), "vLLM's loader and the fake's name map disagree"
    for name, value in want.items():
        torch.testing.assert_close(params[name].data, value, rtol=0, atol=0)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(params) - filled
    assert not getattr(real, "has_own_lm_head", False) and not getattr(real, "has_own_embed_tokens", False)

    with one_rank(config):
        target = Target()
        target.load_weights(policy_weights(0).items())
        # vLLM's own sharing step on the real drafter (the attributes its tail reads, off)
        proposer = types.SimpleNamespace(
            model=real, vllm_config=config, method="eagle3", use_local_argmax_reduction=False
        )
        EagleProposer._maybe_share_embeddings(proposer, target)
        EagleProposer._maybe_share_lm_head(proposer, target)
    assert real.lm_head is target.lm_head and real.model.embed_tokens is target.model.embed_tokens
    assert not tie_draft_head(target, real)  # shared already: nothing to copy


class GraphWrapper:
    """``ACLGraphWrapper`` (``compilation/acl_graph.py:65-240``): captures once per key, records the
    tensors a replay reads; ``unwrap()`` gives the runnable."""

    def __init__(self, model: nn.Module):
        self.runnable, self.read = model, {}

    def unwrap(self):
        return self.runnable

    def tensors(self) -> dict[str, tuple[torch.Tensor, int]]:
        model = self.runnable
        return {n: (t, t.data_ptr()) for n, t in [*model.named_parameters(), *model.named_buffers()]}

    def capture(self) -> None:
        if self.read:
            raise Recapture("captured twice")
        self.read = self.tensors()

    def stale(self) -> list[str]:
        """What a replay would read at a stale address: tensors replaced or moved since capture."""
        now = self.tensors()
        return [
            n for n, (t, ptr) in self.read.items() if n not in now or now[n][0] is not t or now[n][1] != ptr
        ]


class AscendEagleProposer:
    """``AscendEagleProposer`` for ``eagle3`` as far as weights go (module docstring): shares the
    target's embedding (no ``embed_tokens`` in the checkpoint), keeps its own output head, graphs in
    ``_runnable``; the drafter's ``load_weights`` is recorded and checked against the real names."""

    method = "eagle3"

    def __init__(self, drafter: Eagle3LlamaForCausalLM):
        self.model, self.calls = drafter, []

    def load_model(self, target: Target) -> None:
        if not getattr(self.model, "has_own_embed_tokens", False):  # llm_base_proposer.py:403-408
            del self.model.model.embed_tokens
            self.model.model.embed_tokens = target.model.embed_tokens
        # eagle3: no lm_head sharing (llm_base_proposer.py:457)
        self._runnable = GraphWrapper(self.model)
        real_load = self.model.load_weights

        def load_weights(weights):
            weights = list(weights)
            params = dict(self.model.named_parameters())
            shared = {id(m) for m in target.modules()}  # modules: a reload session swaps their tensors
            for name, _ in weights:
                param, _shard = vllm_param_name(name)
                if param not in params:
                    raise UnknownWeight(f"{name!r} -> {param!r}: not a parameter of the drafter")
                if id(self.model.get_submodule(param.rpartition(".")[0])) in shared:
                    raise LoadedIntoTarget(f"{name!r} lands in the target's {param!r}")
            self.calls.append([n for n, _ in weights])
            return real_load(iter(weights))

        self.model.load_weights = load_weights

    def get_model(self):
        return self.model


class AscendWorker(InPlaceReloadMixin):
    """``NPUWorker`` with the extension mixed in: runner with ``model`` (graph-wrapped) and ``drafter``."""

    def __init__(self, config: VllmConfig, target: Target, proposer: AscendEagleProposer):
        self.device, self.vllm_config = torch.device("cpu"), config
        self.model_runner = types.SimpleNamespace(model=GraphWrapper(target), drafter=proposer,
                                                  capture_model=self._recapture)  # fmt: skip

    @staticmethod
    def _recapture(*args, **kwargs):
        raise Recapture("capture_model called during a live weight update")

    def get_model(self):
        return self.model_runner.model.unwrap()

    def push(self, target: str, pairs: list[tuple[str, torch.Tensor]]) -> None:
        """What ``rollout/engine_state.py`` drives: begin, two buckets, finish."""
        with one_rank(self.vllm_config):
            self.areal_begin_update(target)
            for half in (pairs[: len(pairs) // 2], pairs[len(pairs) // 2 :]):
                self.areal_load_bucket(target, pack_bucket(half))
            assert self.areal_finish_update(target) == len(pairs)


@pytest.fixture
def serving(configs, monkeypatch):
    """An Ascend worker after the cold load (drafter from our checkpoint, policy 0), graphs captured.
    vLLM 0.32's ``get_draft_model`` is hidden: the worker takes the drafter as it would on 0.23."""
    features = types.SimpleNamespace(has=lambda name: False if name == "draft_model_accessor" else True)
    monkeypatch.setattr(inplace_reload, "vllm_version", features)
    # Here the CPU stands for the NPU. vLLM keeps the attention's ``_k_scale_cpu``/``_v_scale_cpu`` on
    # the host (``layers/attention/attention.py:146-153``), outside what an NPU worker's
    # ``storage_map`` watches (device tensors only; tests/rollout/test_inplace_reload.py checks that)
    device_map = inplace_reload.storage_map
    monkeypatch.setattr(inplace_reload, "storage_map", lambda model, device: {
        n: v for n, v in device_map(model, device).items() if not n.endswith(HOST_COPIES)})  # fmt: skip
    ours, root = configs
    config = vllm_config(root)
    drafter = build_drafter(config)
    with one_rank(config):
        target = Target()
    for module in (*drafter.modules(), *target.modules()):
        if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
            module.quant_method = Kept()
    record_metadata_for_reloading(target)  # vLLM's initialize_model
    record_metadata_for_reloading(drafter)
    with one_rank(config), torch.no_grad():
        target.load_weights(policy_weights(0).items())
        drafter.load_weights(iter(export(ours)))
    proposer = AscendEagleProposer(drafter)
    proposer.load_model(target)
    worker = AscendWorker(config, target, proposer)
    worker.model_runner.model.capture()
    proposer._runnable.capture()
    return worker, ours, target, drafter


def test_ascend_drafter_keeps_its_own_head_and_the_engine_gives_it_the_targets(serving):
    worker, _, target, drafter = serving
    assert drafter.lm_head is not target.lm_head and drafter.lm_head.weight.isnan().all()  # never loaded
    ptr = drafter.lm_head.weight.data_ptr()
    assert worker.areal_tie_draft_head()  # what the server calls once the engine is up
    torch.testing.assert_close(drafter.lm_head.weight, target.lm_head.weight, rtol=0, atol=0)
    assert drafter.lm_head.weight.data_ptr() == ptr and worker.model_runner.drafter._runnable.stale() == []


def test_policy_and_drafter_sync_in_place_into_the_drafter_not_the_target(serving):
    worker, ours, target, drafter = serving
    worker.areal_tie_draft_head()
    proposer = worker.model_runner.drafter
    policy = policy_weights(1)
    worker.push("policy", list(policy.items()))
    sent = export(ours, scale=-2.0)
    worker.push("draft", sent)

    assert proposer.calls and sorted(n for call in proposer.calls for n in call) == sorted(n for n, _ in sent)
    params = dict(drafter.named_parameters())
    for name, value in expected(sent).items():
        if name != "model.embed_tokens.weight":
            torch.testing.assert_close(params[name].data, value, rtol=0, atol=0)
    padded = torch.zeros_like(target.lm_head.weight)
    padded[:VOCAB] = policy["lm_head.weight"]  # ParallelLMHead's padding rows stay zero
    torch.testing.assert_close(target.lm_head.weight, padded, rtol=0, atol=0)
    torch.testing.assert_close(drafter.lm_head.weight, padded, rtol=0, atol=0)  # the target's head, copied
    assert drafter.model.embed_tokens is target.model.embed_tokens
    # nothing a captured graph reads was replaced, nothing captured again
    assert worker.model_runner.model.stale() == [] and proposer._runnable.stale() == []


@pytest.mark.parametrize(
    "name, error",
    [
        ("embed_tokens.weight", LoadedIntoTarget),  # the shared embedding: the target's tensor
        ("eagle3.fc.weight", UnknownWeight),  # the training prefix left on
        ("layers.0.fc.weight", UnknownWeight),
    ],
)
def test_the_fake_refuses_what_the_real_drafter_would(serving, name, error):
    worker, ours, *_ = serving
    fc = dict(ours.named_parameters())["fc.weight"]
    shape = (VOCAB, H) if "embed" in name else fc.shape
    with pytest.raises(error):
        worker.push("draft", [(name, torch.zeros(shape))])


def test_a_head_split_unlike_the_targets_is_refused(serving):
    _, _, target, drafter = serving
    with torch.no_grad():
        drafter.lm_head.weight = nn.Parameter(torch.zeros(64, H), requires_grad=False)  # lmhead TP: half
    with pytest.raises(RuntimeError, match="lmhead_tensor_parallel_size"):
        tie_draft_head(target, drafter)
