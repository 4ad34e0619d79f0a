"""Why the CPU keeps the hand-written ZeRO-1 (``areal_npu/train/megatron/precision.py``): Megatron-Core's
own ``DistributedOptimizer`` does not build on a CPU-only torch. This fails the day it does (then
use it in place of ``MasterOptimizer``, as issue 29 asks)."""

from __future__ import annotations

import traceback

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the question is about CPU-only torch builds"),
]


def test_megatron_distributed_optimizer_still_needs_cuda():
    from areal_npu.compat.megatron import cuda_device_answers_cpu
    from areal_npu.train.dist import init_distributed
    from areal_npu.train.megatron.runtime import import_megatron, init_parallel_state

    init_distributed()
    import_megatron()
    init_parallel_state()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=True,
                            params_dtype=torch.bfloat16, use_cpu_initialization=True)  # fmt: skip

    class Tiny(MegatronModule):
        def __init__(self):
            super().__init__(cfg)
            self.weight = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    with pytest.raises(AssertionError, match="CUDA") as plain:  # the grad buffer's device
        DistributedDataParallel(cfg, ddp_config, Tiny())
    assert any(f.filename.endswith("param_and_grad_buffer.py") for f in traceback.extract_tb(plain.tb))
    with cuda_device_answers_cpu():  # the shim the engine's CPU path already uses for this call
        ddp = DistributedDataParallel(cfg, ddp_config, Tiny())
        assert ddp.buffers[0].grad_data.device.type == "cpu"
        opt_config = OptimizerConfig(optimizer="adam", lr=1e-3, bf16=True, params_dtype=torch.bfloat16,
                                     use_distributed_optimizer=True)  # fmt: skip
        with pytest.raises(AssertionError, match="CUDA") as literal:  # device='cuda' literals
            get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False)
    frames = [f.filename for f in traceback.extract_tb(literal.tb)]
    assert any(f.endswith("optimizer/distrib_optimizer.py") for f in frames)
    assert any(f.endswith("optimizer/optimizer.py") for f in frames)  # MixedPrecisionOptimizer
