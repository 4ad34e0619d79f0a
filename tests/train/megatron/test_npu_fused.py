"""MindSpeed's fused kernels on the NPU path (``areal_npu/train/megatron/npu_fused.py``), through
recording fakes of ``torch_npu`` and of MindSpeed's packed gated delta rule, each computed by an
independent reference: the fake-routed layers must equal the CPU path's (transformers' Gated DeltaNet
run on each segment alone, torch's RMSNorm, Megatron's own SwiGLU)."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron]

import areal_npu.platform  # noqa: E402
from areal_npu.train.megatron import npu_fused  # noqa: E402

SEGMENTS = (5, 9, 3, 1)


class FakeTorchNpu:
    """``npu_rms_norm`` / ``npu_swiglu`` as documented (torch_npu), by plain formulas; records calls."""

    def __init__(self):
        self.calls = []

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self.calls.append(("npu_rms_norm", x.shape, gamma.shape, epsilon))
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return (x.float() * rstd * gamma.float()).to(x.dtype), rstd

    def npu_swiglu(self, x, dim=-1):
        self.calls.append(("npu_swiglu", x.shape, dim))
        a, b = x.chunk(2, dim=dim)
        return a * torch.sigmoid(a) * b


class FakeMindSpeedRule:
    """MindSpeed's ``chunk_gated_delta_rule`` (FLA's varlen signature): checks what it is handed and
    computes transformers' torch rule on each segment alone, from a zero state."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kw):  # fmt: skip
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        self.calls.append(dict(cu=cu_seqlens, l2=use_qk_l2norm_in_kernel, shapes=(q.shape, v.shape, g.shape)))
        assert cu_seqlens.dtype == torch.long and q.shape[0] == 1 and initial_state is None and not kw
        assert q.shape[:3] == k.shape[:3] and q.shape[2] == v.shape[2] == g.shape[2] == beta.shape[2]
        bounds = cu_seqlens.tolist()
        outs = [
            torch_chunk_gated_delta_rule(
                q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )[0]
            for a, b in zip(bounds[:-1], bounds[1:])
        ]  # fmt: skip
        return torch.cat(outs, dim=1), None


@pytest.fixture
def fake_npu(monkeypatch):
    fake = FakeTorchNpu()
    monkeypatch.setattr(areal_npu.platform, "import_torch_npu", lambda: fake)
    return fake


def _gdn_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6, vocab_size=16,
    )  # fmt: skip


def test_packed_gdn_through_mindspeed_equals_the_layer_on_each_segment(fake_npu):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from areal_npu.compat.transformers import unpatched_forward

    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(_gdn_config(), 0).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hidden = torch.randn(1, sum(SEGMENTS), 32, dtype=torch.float64)
    upstream = torch.randn_like(hidden)
    cu = torch.tensor([0, *torch.tensor(SEGMENTS).cumsum(0).tolist()], dtype=torch.int32)

    x_ref = hidden.clone().requires_grad_()
    forward = unpatched_forward(Qwen3_5GatedDeltaNet)
    ref = torch.cat([forward(layer, x_ref[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)
    (ref * upstream).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()

    rule = FakeMindSpeedRule()
    x = hidden.clone().requires_grad_()
    out = npu_fused.packed_gdn_forward(layer, x, cu, rule)
    (out * upstream).sum().backward()
    assert len(rule.calls) == 1 and rule.calls[0]["l2"]  # one call over the whole row
    assert rule.calls[0]["cu"].tolist() == cu.tolist()
    assert rule.calls[0]["shapes"] == ((1, 18, 4, 8), (1, 18, 4, 6), (1, 18, 4))  # q/k repeated to Hv
    assert [c[0] for c in fake_npu.calls] == ["npu_rms_norm"]  # the gated norm, fused
    # transformers' torch rule casts to float32 inside, so the two float64 routes (conv by shifted
    # taps vs conv1d) agree to float32 rounding, relative to each tensor's scale (measured <= 2e-6)
    for name, got, want in [("out", out, ref), ("input", x.grad, x_ref.grad)] + [
        (n, p.grad, ref_grads[n]) for n, p in layer.named_parameters()
    ]:
        torch.testing.assert_close(got, want, rtol=0, atol=2**-16 * want.abs().max().item(), msg=name)


def test_segment_aware_conv_equals_conv1d_on_each_segment():
    torch.manual_seed(1)
    x, w = torch.randn(6, 17, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    cu = torch.tensor([0, 1, 7, 9, 17])
    ref = torch.cat(
        [
            F.conv1d(x[None, :, a:b], w[:, None], padding=3, groups=6)[0, :, : b - a]
            for a, b in zip(cu[:-1], cu[1:])
        ],
        dim=1,
    )
    torch.testing.assert_close(npu_fused.causal_conv_in_segments(x, w, cu), ref)


def test_gdn_rule_is_mindspeeds_on_the_npu_in_half_precision_only(monkeypatch):
    kernel = object()
    monkeypatch.setitem(
        sys.modules, npu_fused.MINDSPEED_GDN_MODULE, types.SimpleNamespace(chunk_gated_delta_rule=kernel)
    )
    assert npu_fused.gdn_rule(torch.zeros(2, device="meta", dtype=torch.bfloat16)) is None  # not an NPU

    class NpuTensor:  # what the rule looks at: device type and dtype
        device, dtype = torch.device("meta"), torch.bfloat16

    NpuTensor.device = types.SimpleNamespace(type="npu")
    assert npu_fused.gdn_rule(NpuTensor) is kernel
    NpuTensor.dtype = torch.float32  # MindSpeed's kernel refuses float32: the torch path runs
    assert npu_fused.gdn_rule(NpuTensor) is None


def test_fused_rmsnorm_and_swiglu_equal_torch_and_megatron(fake_npu):
    torch.manual_seed(2)
    x = torch.randn(5, 3, 16)
    norm = npu_fused.FusedRMSNorm(16, 1e-5, torch.float32, sequence_parallel=True)
    ref = torch.nn.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
        ref.weight.copy_(norm.weight)
    torch.testing.assert_close(norm(x), ref(x))
    assert norm.weight.sequence_parallel and fake_npu.calls[-1] == ("npu_rms_norm", x.shape, (16,), 1e-5)

    h = torch.randn(7, 2, 24)
    x_glu, x_linear = torch.chunk(h, 2, dim=-1)  # Megatron MLP's glu: activation(x_glu) * x_linear
    torch.testing.assert_close(npu_fused.FusedSwiGLU()(h), F.silu(x_glu) * x_linear)
    assert fake_npu.calls[-1] == ("npu_swiglu", h.shape, -1)


def test_megatrons_mlp_and_norms_built_from_the_npu_spec_equal_the_cpu_ones(fake_npu, monkeypatch):
    """The NPU config + spec through Megatron's own MLP (``use_te_activation_func`` builds the spec's
    activation module) against the CPU config + spec (Megatron's own glu), same weights."""
    from megatron.core.transformer.spec_utils import build_module

    from areal_npu.train.dist import init_distributed
    from areal_npu.train.megatron import model, specs
    from areal_npu.train.megatron.runtime import init_parallel_state
    from tests.support.megatron_tiny import tiny_qwen3

    init_distributed()
    init_parallel_state()
    hf_config, _ = tiny_qwen3()
    built = {}
    for npu in (False, True):
        for module in (npu_fused, specs, model):
            monkeypatch.setattr(module, "fused_kernels", lambda npu=npu: npu)
        cfg = model.transformer_config(hf_config)
        spec = specs.layer_spec().submodules
        assert cfg.use_te_activation_func is npu
        torch.manual_seed(0)
        built[npu] = (build_module(spec.mlp, config=cfg), build_module(spec.input_layernorm, config=cfg,
                      hidden_size=cfg.hidden_size, eps=cfg.layernorm_epsilon))  # fmt: skip
    (mlp_cpu, norm_cpu), (mlp_npu, norm_npu) = built[False], built[True]
    assert isinstance(mlp_npu.activation_func, npu_fused.FusedSwiGLU)
    assert isinstance(norm_npu, npu_fused.FusedRMSNorm) and isinstance(norm_cpu, torch.nn.RMSNorm)
    with torch.no_grad():  # the config leaves weights uninitialised (they come from checkpoints)
        for p in [*mlp_cpu.parameters(), norm_cpu.weight]:
            p.normal_(0, 0.5)
        mlp_npu.load_state_dict(mlp_cpu.state_dict())
        norm_npu.load_state_dict(norm_cpu.state_dict())
    x = torch.randn(6, 1, cfg.hidden_size)
    torch.testing.assert_close(mlp_npu(x)[0], mlp_cpu(x)[0])
    torch.testing.assert_close(norm_npu(x), norm_cpu(x))
    assert {c[0] for c in fake_npu.calls} == {"npu_swiglu", "npu_rms_norm"}
