"""The live weight update keeps captured graphs valid (areal_npu/rollout/inplace_reload.py).

Recording fakes of a vLLM-Ascend worker: a model runner whose target sits in an ACLGraph-style
wrapper and whose MTP drafter shares the target's embedding and output head (as vLLM-Ascend's
proposer does), and fake graphs that replay against the tensors they captured -- a tensor replaced
after capture is read at its old address, as on the device. The runner's ``capture_model`` and a
fake ``torch.npu.graph`` / ``NPUGraph`` fail the test when called. The layers process their weights
the way vLLM-Ascend 0.23 does for the models served here: unquantized linear kept as loaded (NZ
off), MoE experts transposed into a new ``Parameter``. vLLM's real layer-wise reload helpers run,
and a real ``QKVParallelLinear`` takes q, k and v through its shard loader (a fused weight loaded in
parts, across buckets).
"""

from __future__ import annotations

import contextlib
import types
from unittest import mock

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")
import vllm.model_executor.layers.linear as vllm_linear  # noqa: E402
import vllm.model_executor.parameter as vllm_parameter  # noqa: E402
from vllm.config import CUDAGraphMode, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # noqa: E402
from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading  # noqa: E402
from vllm.model_executor.model_loader.weight_utils import default_weight_loader  # noqa: E402

from areal_npu.rollout import inplace_reload  # noqa: E402
from areal_npu.rollout.buckets import pack_bucket  # noqa: E402
from areal_npu.rollout.inplace_reload import GraphUnsafeReload, InPlaceReloadMixin  # noqa: E402

H, E, V, POS = 4, 2, 11, 16  # hidden, experts, vocab, rotary positions (experts' 2I = 2H)


class Recapture(AssertionError):
    """A graph was captured again, or something asked for a capture."""


class Kept(QuantizeMethodBase):
    """vLLM-Ascend's unquantized linear with NZ off: ``layer.weight.data = maybe_trans_nz(...)``
    is the identity (``ops/linear.py:86-98``)."""

    def create_weights(self, *args, **kwargs):
        pass

    def apply(self, layer, x, bias=None):
        return x @ layer.weight.T

    def process_weights_after_loading(self, layer):
        layer.weight.data = layer.weight.data


class AscendMoE(Kept):
    """vLLM-Ascend 0.23's unquantized MoE (``ops/fused_moe/fused_moe.py:112-118``): the checkpoint
    layout [E, 2I, H] becomes a new contiguous [E, H, 2I] ``Parameter``."""

    def process_weights_after_loading(self, layer):
        layer.w13_weight = nn.Parameter(
            layer.w13_weight.data.transpose(1, 2).contiguous(), requires_grad=False
        )


class Derived(Kept):
    """A derived tensor kept as a plain attribute (DeepSeek-V4's ``weight_fp32``): re-derived into a
    new tensor on every load (before vLLM-Ascend #15666), or copied into the old one (after)."""

    def __init__(self, in_place: bool):
        self.in_place = in_place

    def process_weights_after_loading(self, layer):
        new = layer.weight.data.t().contiguous()
        old = getattr(layer, "weight_t", None)
        if self.in_place and old is not None:
            old.copy_(new)
        else:
            layer.weight_t = new


def param(*shape) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = default_weight_loader
    return p


class Layer(nn.Module):
    def __init__(self, method: QuantizeMethodBase, **params):
        super().__init__()
        self.quant_method = method
        for name, shape in params.items():
            self.register_parameter(name, param(*shape))


class Rotary(nn.Module):
    """A rotary cache: a buffer computed at build time, never loaded."""

    def __init__(self):
        super().__init__()
        self.register_buffer(
            "cos_sin_cache", torch.cos(torch.arange(POS * H, dtype=torch.float32)).view(POS, H)
        )


def one_rank():
    """vLLM's parallel layers built without a process group: tensor-parallel rank 0 of 1."""
    stack = contextlib.ExitStack()
    stack.enter_context(set_current_vllm_config(VllmConfig()))
    for module in (vllm_linear, vllm_parameter):
        for name, value in (
            ("get_tensor_model_parallel_world_size", 1),
            ("get_tensor_model_parallel_rank", 0),
        ):
            if hasattr(module, name):
                stack.enter_context(mock.patch.object(module, name, return_value=value))
    return stack


def fused_qkv() -> nn.Module:
    """vLLM's fused q/k/v projection: 2 query heads and 1 kv head of size 2 -> rows q 0:4, k 4:6, v 6:8."""
    layer = vllm_linear.QKVParallelLinear(H, 2, 2, 1, bias=False, params_dtype=torch.float32)
    layer.quant_method = Kept()  # the CPU backend's method would repack; Ascend's keeps it (NZ off)
    return layer


STACKED = {".q_proj.weight": "q", ".k_proj.weight": "k", ".v_proj.weight": "v"}  # as vLLM models map them


class LoadsLikeVLLM(nn.Module):
    def load_weights(self, weights):
        for name, w in weights:
            name, shard = self.rename(name), ()
            for suffix, shard_id in STACKED.items():
                if name.endswith(suffix):
                    name, shard = name.removesuffix(suffix) + ".weight", (shard_id,)
            p = dict(self.named_parameters())[name]  # looked up each time: the reload swaps tensors
            getattr(p, "weight_loader", default_weight_loader)(p, w, *shard)

    def rename(self, name: str) -> str:
        return name


class Target(LoadsLikeVLLM):
    def __init__(self, derived: Derived | None = None):
        super().__init__()
        self.embed = Layer(Kept(), weight=(V, H))
        self.proj = Layer(derived or Kept(), weight=(H, H))
        self.qkv = fused_qkv()
        self.experts = Layer(AscendMoE(), w13_weight=(E, 2 * H, H))
        self.rotary = Rotary()
        self.lm_head = Layer(Kept(), weight=(V, H))

    def forward(self, ids):
        h = self.embed.weight[ids] * self.rotary.cos_sin_cache[ids % POS]
        h = h @ (self.proj.weight_t if hasattr(self.proj, "weight_t") else self.proj.weight.T)
        a = h @ self.qkv.weight.T
        h = h + a[:, :H] + a[:, H:].sum(-1, keepdim=True)
        h = h + (h @ self.experts.w13_weight.sum(0))[:, :H]
        return h @ self.lm_head.weight.T


class Drafter(LoadsLikeVLLM):
    """The MTP drafter: its own ``fc`` and norm; embedding and output head are the target's."""

    def __init__(self, target: Target):
        super().__init__()
        self.fc = Layer(Kept(), weight=(H, 2 * H))
        self.norm = Layer(Kept(), weight=(H,))
        record_metadata_for_reloading(self)  # vLLM's initialize_model, before the sharing below
        self.embed, self.lm_head = target.embed, target.lm_head  # llm_base_proposer.py:440-480

    def rename(self, name):
        return name.removeprefix("mtp.")

    def forward(self, ids):
        h = torch.cat([self.embed.weight[ids], self.embed.weight[(ids + 1) % V]], -1) @ self.fc.weight.T
        return (h * self.norm.weight) @ self.lm_head.weight.T


def reference(w: dict[str, torch.Tensor], ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' logits computed straight from checkpoint tensors (experts transposed by hand)."""
    cache = torch.cos(torch.arange(POS * H, dtype=torch.float32)).view(POS, H)
    h = w["embed.weight"][ids] * cache[ids % POS] @ w["proj.weight"].T
    a = h @ torch.cat([w[f"qkv.{x}_proj.weight"] for x in "qkv"]).T
    h = h + a[:, :H] + a[:, H:].sum(-1, keepdim=True)
    h = h + (h @ w["experts.w13_weight"].transpose(1, 2).sum(0))[:, :H]
    g = torch.cat([w["embed.weight"][ids], w["embed.weight"][(ids + 1) % V]], -1) @ w["mtp.fc.weight"].T
    return h @ w["lm_head.weight"].T, (g * w["mtp.norm.weight"]) @ w["lm_head.weight"].T


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (V, H), "proj.weight": (H, H), "qkv.q_proj.weight": (H, H),
              "qkv.k_proj.weight": (2, H), "qkv.v_proj.weight": (2, H), "experts.w13_weight": (E, 2 * H, H),
              "lm_head.weight": (V, H), "mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,)}  # fmt: skip
    return {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}


class FakeGraph:
    """Captures once; a replay reads the tensor objects seen at capture (parameters, buffers and
    plain tensor attributes), whatever the modules hold now -- as a device graph reads addresses."""

    def __init__(self, model: nn.Module):
        self.model, self.captured = model, []
        for module in model.modules():
            for kind in ("_parameters", "_buffers"):
                self.captured += [(module, kind, n, t) for n, t in getattr(module, kind).items()]
            self.captured += [
                (module, None, n, t) for n, t in vars(module).items() if isinstance(t, torch.Tensor)
            ]

    def replay(self, ids):
        saved = [
            (m, kind, n, (getattr(m, kind)[n] if kind else vars(m)[n])) for m, kind, n, _ in self.captured
        ]
        for m, kind, n, t in self.captured:
            (getattr(m, kind) if kind else vars(m))[n] = t
        try:
            with torch.no_grad():
                return self.model(ids)
        finally:
            for m, kind, n, t in saved:
                (getattr(m, kind) if kind else vars(m))[n] = t


class GraphWrapper:
    """vLLM-Ascend's ``ACLGraphWrapper`` (``compilation/acl_graph.py``): one graph per batch
    descriptor, captured on first use; ``unwrap()`` gives the model."""

    def __init__(self, model):
        self.runnable, self.entries = model, {}

    def unwrap(self):
        return self.runnable

    def capture(self, key: str) -> FakeGraph:
        if key in self.entries:
            raise Recapture(f"graph {key!r} captured twice")
        self.entries[key] = FakeGraph(self.runnable)
        return self.entries[key]


class Worker(InPlaceReloadMixin):
    """An ``NPUWorker`` with the extension mixed in, its runner's target in a graph wrapper."""

    def __init__(self, target: Target, drafter: Drafter, graphs: bool):
        self.device = torch.device("cpu")
        self.vllm_config = VllmConfig()
        self.vllm_config.compilation_config.cudagraph_mode = (
            CUDAGraphMode.FULL if graphs else CUDAGraphMode.NONE
        )
        dtype = types.SimpleNamespace(dtype=torch.float32)
        self.vllm_config.speculative_config = types.SimpleNamespace(method="mtp", draft_model_config=dtype)
        # the proposer keeps the raw drafter in ``model`` and its graph in ``_runnable``
        proposer = types.SimpleNamespace(model=drafter, _runnable=GraphWrapper(drafter))
        self.model_runner = types.SimpleNamespace(model=GraphWrapper(target), drafter=proposer)
        self.model_runner.capture_model = self._recapture

    @staticmethod
    def _recapture(*args, **kwargs):
        raise Recapture("capture_model called during a live weight update")

    def get_model(self):
        return self.model_runner.model.unwrap()

    def get_draft_model(self):
        return self.model_runner.drafter.model

    def push(self, target: str, weights: dict[str, torch.Tensor]) -> None:
        """What ``rollout/engine_state.py`` drives: begin, buckets, finish."""
        names = [n for n in weights if n.startswith("mtp.") == (target == "draft")]
        self.areal_begin_update(target)
        for half in (names[: len(names) // 2], names[len(names) // 2 :]):
            self.areal_load_bucket(target, pack_bucket([(n, weights[n]) for n in half]))
        assert self.areal_finish_update(target) == len(names)


def cold_load(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """vLLM's loader: ``load_weights``, then each layer's ``process_weights_after_loading``."""
    model.load_weights(list(weights.items()))
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
            module.quant_method.process_weights_after_loading(module)


def serving(graphs: bool = True, derived: Derived | None = None):
    """A worker after vLLM's cold load of checkpoint 0 and one capture of each graph."""
    with one_rank():
        target = Target(derived)
    record_metadata_for_reloading(target)  # vLLM's initialize_model
    drafter = Drafter(target)
    worker, old = Worker(target, drafter, graphs), checkpoint(0)
    cold_load(target, {n: w for n, w in old.items() if not n.startswith("mtp.")})
    cold_load(drafter, {n: w for n, w in old.items() if n.startswith("mtp.")})
    runner = worker.model_runner
    return worker, old, runner.model.capture("decode"), runner.drafter._runnable.capture("decode")


@pytest.fixture(autouse=True)
def _no_device_graphs(monkeypatch):
    def refuse(*args, **kwargs):
        raise Recapture("a device graph was built during a live weight update")

    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(graph=refuse, NPUGraph=refuse), raising=False)


def addresses(model: nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    return {n: (t, t.data_ptr()) for n, t in [*model.named_parameters(), *model.named_buffers()]}


IDS = torch.tensor([1, 5, 7, 10])


def test_target_and_drafter_reload_in_place_and_captured_graphs_serve_the_new_weights():
    worker, old, target_graph, draft_graph = serving()
    wrappers = (worker.model_runner.model, worker.model_runner.drafter._runnable)
    target, drafter = worker.get_model(), worker.get_draft_model()
    before = {"target": addresses(target), "drafter": addresses(drafter)}
    stale = reference(old, IDS)
    torch.testing.assert_close((target_graph.replay(IDS), draft_graph.replay(IDS)), stale)

    new = checkpoint(1)
    worker.push("policy", new)
    worker.push("draft", new)

    for name, model in (("target", target), ("drafter", drafter)):
        now = addresses(model)
        assert now.keys() == before[name].keys()
        for n, (tensor, ptr) in before[name].items():
            assert now[n][0] is tensor and now[n][1] == ptr, f"{name}.{n} was reallocated"
    assert drafter.embed is target.embed and drafter.lm_head is target.lm_head
    # the same graph wrappers hold the same graphs, captured at start: nothing rebuilt or captured
    assert worker.model_runner.model is wrappers[0] and worker.model_runner.drafter._runnable is wrappers[1]
    assert wrappers[0].entries == {"decode": target_graph} and wrappers[1].entries == {"decode": draft_graph}
    want = reference(new, IDS)
    torch.testing.assert_close((target_graph.replay(IDS), draft_graph.replay(IDS)), want)
    assert (want[0] - stale[0]).abs().max() > 0.5 and (want[1] - stale[1]).abs().max() > 0.5


class ReplacingLoad(Worker):
    """A load that replaces the tensors instead of writing into them: the new weights go into a
    model built aside, whose tensors are then assigned to the serving one (no layer-wise session)."""

    def areal_begin_update(self, target):
        model, _ = self._areal_target(target)
        self._areal_loaded = {
            "target": target,
            "names": 0,
            "before": inplace_reload.storage_map(model, self.device),
        }

    def _areal_load(self, target, weights):
        self._areal_loaded.setdefault("weights", {}).update(weights)
        self._areal_loaded["names"] += len(weights)
        return len(weights)

    def areal_finish_update(self, target):
        model, _ = self._areal_target(target)
        with one_rank():
            aside = Target()
        cold_load(aside, self._areal_loaded["weights"])
        model.load_state_dict(dict(aside.named_parameters()), strict=False, assign=True)
        return super().areal_finish_update(target)


def test_a_sequence_that_reallocates_is_refused_where_graphs_read_the_old_tensors():
    worker, old, target_graph, _ = serving()
    worker.__class__ = ReplacingLoad
    new = checkpoint(1)
    with pytest.raises(GraphUnsafeReload, match=r"moved 5 tensor.*experts\.w13_weight"):
        worker.push("policy", new)
    # why: the captured graph still reads the tensors it saw at capture, now stale
    live = worker.get_model()(IDS)
    torch.testing.assert_close(live, reference(new, IDS)[0])
    assert (target_graph.replay(IDS) - live).abs().max() > 1e-3


def test_in_eager_mode_a_reallocation_is_only_logged(caplog):
    caplog.set_level("INFO", logger=inplace_reload.__name__)
    worker, old, _, _ = serving(graphs=False)
    worker.__class__ = ReplacingLoad
    new = checkpoint(1)
    worker.push("policy", new)
    torch.testing.assert_close(worker.get_model()(IDS), reference(new, IDS)[0])
    assert "moved 5 tensor(s)" in caplog.text


@pytest.mark.parametrize("in_place", [True, False], ids=["copied-in-place", "re-derived"])
def test_a_derived_tensor_must_be_refreshed_in_place(in_place):
    worker, old, target_graph, _ = serving(derived=Derived(in_place))
    new = checkpoint(1)
    if in_place:
        worker.push("policy", new)
        torch.testing.assert_close(target_graph.replay(IDS), reference(new, IDS)[0])
    else:
        with pytest.raises(GraphUnsafeReload, match=r"proj\.weight_t"):
            worker.push("policy", new)


def test_a_model_vllm_did_not_record_is_refused_before_it_is_touched():
    worker, *_ = serving()
    target = worker.get_model()
    target.extra = Layer(Kept(), weight=(H,))  # built after vLLM's initialize_model
    before = addresses(target)
    with pytest.raises(RuntimeError, match="no layer-wise restore metadata"):
        worker.areal_begin_update("policy")
    assert {n: (t, t.data_ptr()) for n, (t, _) in before.items()} == before
    assert not any(t.is_meta for t, _ in addresses(target).values())


@pytest.mark.parametrize("nz_mode", [0, 1])
def test_on_ascend_nz_weights_are_refused(monkeypatch, nz_mode):
    config = types.SimpleNamespace(weight_nz_mode=nz_mode)
    fake = types.ModuleType("vllm_ascend.ascend_config")
    fake.get_ascend_config = lambda: config
    monkeypatch.setitem(__import__("sys").modules, "vllm_ascend", types.ModuleType("vllm_ascend"))
    monkeypatch.setitem(__import__("sys").modules, "vllm_ascend.ascend_config", fake)
    worker, *_ = serving()
    if nz_mode:
        with pytest.raises(RuntimeError, match="VLLM_ASCEND_ENABLE_NZ=0"):
            inplace_reload.check_reloadable(worker.get_model(), "npu:0")
    else:
        inplace_reload.check_reloadable(worker.get_model(), "npu:0")


def test_only_tensors_on_the_workers_device_are_watched():
    worker, *_ = serving()
    target = worker.get_model()
    on_cpu = inplace_reload.storage_map(target, "cpu")
    assert set(on_cpu) == {n for n, _ in [*target.named_parameters(), *target.named_buffers()]}
    assert inplace_reload.storage_map(target, "npu:0") == {}  # host tensors: no device graph reads them
