"""Megatron's model-parallel RNG states are registered the way its training loop registers them
(``model_parallel_cuda_manual_seed``, by ``init_parallel_state``), and sequence parallelism needs
them: two gloo ranks (TP=2, sequence parallel) compute log-probs, then with the tracker emptied the
same call fails with Megatron's own error -- the CPU tracker of ``compat/megatron.py`` does not hide
a missing registration. Reference for the seeds: Megatron's documented rule (data-parallel
``seed``, tensor-parallel ``seed + 2718 + tp_rank``, expert ``seed + 1024 + 100 ep_rank + etp_rank``).
"""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

from areal_npu.train.dist import process_group  # noqa: E402
from tests.support.megatron_tiny import make_samples, megatron_config, ranks_fit, tiny_qwen3  # noqa: E402
from tests.support.ranks import start_processes  # noqa: E402


def _worker(rank, world, rdv, out):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    from areal_npu.train.megatron.engine import MegatronEngine

    with process_group(rank, world, f"file://{rdv}"):
        cfg = megatron_config(2)
        cfg.megatron.sequence_parallel = True
        engine = MegatronEngine.from_hf_model(tiny_qwen3()[1], cfg)
        tracker = get_cuda_rng_tracker()
        result = {"names": sorted(tracker.get_states()), "seeds": sorted(tracker.seeds_)}
        samples = make_samples(3)
        result["logp"] = [t.numel() for t in engine.compute_logprobs(samples)]
        tracker.reset()  # as if nothing had registered the states
        try:
            engine.compute_logprobs(samples)
            result["error"] = None
        except Exception as exc:  # noqa: BLE001 -- Megatron raises a bare Exception
            result["error"] = str(exc)
        torch.save(result, f"{out}.{rank}")


@pytest.mark.skipif(not ranks_fit(2), reason="two ranks need two accelerators on this machine")
def test_sequence_parallelism_runs_on_the_registered_rng_states_and_fails_without_them(tmp_path):
    from areal_npu.train.megatron.runtime import SEED

    start_processes(_worker, args=(2, str(tmp_path / "rdv"), str(tmp_path / "out")), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"out.{rank}", weights_only=False)
        assert got["names"] == ["data-parallel-rng", "expert-parallel-rng", "model-parallel-rng"]
        assert got["seeds"] == sorted({SEED, SEED + 2718 + rank, SEED + 1024 + rank})
        assert len(got["logp"]) == 3 and min(got["logp"]) > 0  # it ran under sequence parallelism
        assert got["error"] is not None and "model-parallel-rng is not added" in got["error"]
