"""The Megatron-Core CPU shims: each one still needed upstream (the test fails once it is not), and exact."""

import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the shims are for CPU-only torch builds"),
]

from areal_npu.compat.megatron import CPU_DEVICE_SHIMS, apply_cpu_patches, unpatched  # noqa: E402

ROTARY = ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_emb")


def _rotary():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding(kv_channels=8, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)


def test_upstream_rotary_still_moves_inv_freq_to_cuda():
    """Fails once Megatron's RotaryEmbedding.get_emb runs on a CPU-only build: then drop the shim."""
    rotary = _rotary()
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        unpatched(*ROTARY)(rotary, 4)


def test_patched_rotary_is_the_rope_table_on_the_cpu():
    assert "{}.{}".format(*ROTARY) in apply_cpu_patches()
    assert apply_cpu_patches() == apply_cpu_patches()  # idempotent: one wrapper
    rotary = _rotary()
    emb = rotary.get_emb(5)  # [positions, 1, 1, dim], non-interleaved: cat(freqs, freqs)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    freqs = torch.arange(5, dtype=torch.float32)[:, None] * inv_freq[None]
    torch.testing.assert_close(emb[:, 0, 0], torch.cat([freqs, freqs], -1), rtol=0, atol=0)
    assert emb.device.type == "cpu" and rotary.inv_freq.device.type == "cpu"
    with pytest.raises((AssertionError, RuntimeError)):  # the stand-in lives only inside the call
        torch.cuda.current_device()


def test_every_shim_is_listed_with_a_reason_and_applied():
    applied = apply_cpu_patches()
    for module, path, why in CPU_DEVICE_SHIMS:
        assert why and f"{module}.{path}" in applied
        assert unpatched(module, path) is not None


class _TwoRankGroup:
    """Stands for a 2-rank TP group up to the first collective (the upstream functions size and
    allocate their output before they communicate)."""

    def size(self):
        return 2

    def rank(self):
        return 0


MAPPINGS = "megatron.core.tensor_parallel.mappings"


@pytest.mark.parametrize(
    "name,shape",
    [("_gather_along_last_dim", (3, 1, 4)), ("_reduce_scatter_along_first_dim", (4, 3)), ("_gather_along_first_dim", (2, 3))],
)  # fmt: skip
def test_upstream_tp_collectives_still_allocate_on_cuda(name, shape):
    """Fails once Megatron allocates these outputs where the input lives: then drop the shims.
    (That the shimmed collectives are exact is checked end to end over two gloo ranks:
    ``tests/train/megatron/test_tp_kv_replicated.py``, TP=2 with one KV head and sequence
    parallelism == one process.)"""
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        unpatched(MAPPINGS, name)(torch.zeros(shape), _TwoRankGroup())


def test_upstream_global_buffer_still_allocates_on_cuda_and_the_shim_allocates_on_the_cpu():
    from megatron.core.utils import GlobalMemoryBuffer

    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        unpatched("megatron.core.utils", "GlobalMemoryBuffer.get_tensor")(
            GlobalMemoryBuffer(), (2, 3), torch.float32, "t"
        )
    apply_cpu_patches()
    out = GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "t")
    assert out.shape == (2, 3) and out.device.type == "cpu"


def test_upstream_linear_backward_still_allocates_its_sp_gradient_on_cuda():
    """The sequence-parallel branch of the linear layer's backward (reduce-scatter of the input
    gradient) allocates on CUDA: called with a stand-in ``ctx`` up to that allocation."""
    from types import SimpleNamespace

    ctx = SimpleNamespace(
        saved_tensors=(torch.zeros(2, 3), torch.zeros(4, 3)),
        main_grad=None,
        use_bias=False,
        grad_output_buffer=[],
        wgrad_deferral_limit=0,
        tp_group=_TwoRankGroup(),
        gradient_accumulation_fusion=False,
        sequence_parallel=True,
        allreduce_dgrad=False,
        _fwd_used_autocast=False,
        _dtype=torch.float32,
    )
    backward = unpatched(
        "megatron.core.tensor_parallel.layers", "LinearWithGradAccumulationAndAsyncCommunication.backward"
    )
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        backward(ctx, torch.zeros(4, 4))


def test_the_cpu_rng_tracker_keeps_megatrons_registration_check_and_its_fork_draws_nothing():
    """Upstream's training tracker cannot fork on a CPU-only build (no CUDA RNG state); after the
    patches the tracker keeps its bookkeeping: a fork of a state never registered fails as on a GPU
    (the shim does not hide a missing ``model_parallel_cuda_manual_seed``), a registered one forks
    and leaves every RNG untouched."""
    from megatron.core.tensor_parallel import random as mrandom

    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        training = mrandom.CudaRNGStatesTracker()
        training.add("model-parallel-rng", 3)
        with training.fork():
            pass
    apply_cpu_patches()
    tracker = mrandom.get_cuda_rng_tracker()
    assert (
        isinstance(tracker, mrandom.CudaRNGStatesTracker) and type(tracker).__name__ == "CpuRNGStatesTracker"
    )
    saved = tracker.get_states()
    try:
        tracker.reset()
        with pytest.raises(Exception, match="model-parallel-rng is not added"):
            with tracker.fork():
                pass
        tracker.add("model-parallel-rng", 3)
        with pytest.raises(Exception, match="seed 3 already exists"):
            tracker.add("another", 3)
        before = torch.get_rng_state()
        with tracker.fork():
            pass
        assert torch.equal(before, torch.get_rng_state())
    finally:
        tracker.reset()
        tracker.set_states(saved)


RANDOM = "megatron.core.tensor_parallel.random"


def test_upstream_recomputation_still_reads_the_cuda_rng_state():
    """Fails once Megatron's ``CheckpointFunction`` saves its RNG states without CUDA on a CPU-only
    build: then drop the RNG shim (:data:`CPU_RNG_SHIMS`)."""
    from types import SimpleNamespace

    from megatron.core.tensor_parallel import random as mrandom

    forward = unpatched(RANDOM, "CheckpointFunction.forward")
    try:
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            forward(SimpleNamespace(), lambda x: x, False, torch.ones(2))
    finally:
        mrandom._unset_checkpointing()


def test_patched_recomputation_replays_the_forwards_random_stream():
    """A checkpointed dropout: the backward's re-run must draw the forward's mask (the gradient of
    ``sum(dropout(x))`` is ``mask / (1 - p)``), and leave the CPU generator as it found it."""
    from megatron.core.tensor_parallel import random as mrandom

    from areal_npu.compat.megatron import CPU_RNG_SHIMS

    applied = apply_cpu_patches()
    assert all(f"{m}.{p}" in applied and why for m, p, why in CPU_RNG_SHIMS)
    original_get = mrandom._get_cuda_rng_state
    queued = len(torch.cuda._queued_calls)
    torch.manual_seed(0)
    x = torch.ones(64, requires_grad=True)
    y = mrandom.checkpoint(lambda t: torch.nn.functional.dropout(t, 0.5, training=True), False, x)
    mask = y.detach() != 0
    assert 0 < int(mask.sum()) < 64
    torch.manual_seed(1)  # the generator moves on before the backward
    before = torch.get_rng_state()
    y.sum().backward()
    torch.testing.assert_close(x.grad, mask.float() * 2.0, rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), before)
    assert mrandom._get_cuda_rng_state is original_get  # swapped only while the shim runs
    assert len(torch.cuda._queued_calls) == queued  # nothing queued for a CUDA that never starts


P2P = "megatron.core.pipeline_parallel.p2p_communication"


def test_upstream_pipeline_p2p_still_allocates_on_cuda():
    """Fails once Megatron's P2PCommunicator allocates its shape messages and receive buffers
    without CUDA: then drop :data:`CPU_P2P_SHIMS`. (That the shimmed sends and receives are exact
    is checked end to end: ``tests/train/megatron/test_pipeline.py``, two stages == one process.)"""
    from types import SimpleNamespace

    config = SimpleNamespace(use_ring_exchange_p2p=False, variable_seq_lengths=False, mtp_standalone=False,
                             pipeline_dtype=torch.float32, batch_p2p_comm=False)  # fmt: skip
    comm = SimpleNamespace(config=config, pp_group=None, prev_rank=0, next_rank=1)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        unpatched(P2P, "P2PCommunicator._communicate_shapes")(comm, None, None, True, False)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        unpatched(P2P, "P2PCommunicator._communicate")(
            comm, tensor_send_next=None, tensor_send_prev=None, recv_prev=True, recv_next=False,
            tensor_shape=(2, 1, 4),
        )  # fmt: skip


def test_upstream_schedule_still_counts_tokens_on_cuda_and_the_shim_moves_only_cuda_zeros():
    """Fails once the 1F1B schedule stops allocating ``torch.zeros(..., device="cuda")``: then drop
    :data:`CPU_SCHEDULE_SHIMS`. The shim redirects that literal and nothing else."""
    import inspect

    from areal_npu.compat.megatron import CPU_P2P_SHIMS, CPU_SCHEDULE_SHIMS, cuda_zeros_on_the_cpu

    schedule = unpatched(*CPU_SCHEDULE_SHIMS[0][:2])
    assert 'device="cuda"' in inspect.getsource(schedule)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.zeros([], dtype=torch.int, device="cuda")
    with cuda_zeros_on_the_cpu():
        moved = torch.zeros([], dtype=torch.int, device="cuda")
        assert moved.device.type == "cpu" and moved.dtype == torch.int and int(moved) == 0
        assert torch.zeros(2, 3).shape == (2, 3)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):  # only while it runs
        torch.zeros([], device="cuda")
    applied = apply_cpu_patches()
    assert all(f"{m}.{p}" in applied and why for m, p, why in CPU_P2P_SHIMS + CPU_SCHEDULE_SHIMS)
