"""CPU shims for Megatron-Core 0.16.1: what it takes to run its GPTModel on a CPU-only torch build.

Megatron-Core assumes CUDA in a few places that have nothing to do with the maths: it allocates
helper tensors on ``torch.cuda.current_device()``. On a CPU-only build that call raises
("Torch not compiled with CUDA enabled"). Each shim below makes one such upstream function see
``"cpu"`` as the current CUDA device *while it runs*, so the upstream code itself still runs (no
copied Megatron code to drift from upstream). :func:`apply_cpu_patches` applies them all, once;
the engine calls it only when the platform is the CPU (never on NPU, where MindSpeed's adaptor
maps these calls to the NPU, nor on CUDA). ``tests/compat/test_megatron.py`` has one test per
shim that fails once upstream stops needing it.

Gloo in torch 2.13 has ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, so TP with fewer KV
heads than ranks and sequence parallelism run over gloo once their buffers are allocated on the CPU
(the mapping and buffer shims below). The CUDA RNG tracker, which Megatron forks around every layer
under sequence parallelism, is Megatron's training tracker with its bookkeeping kept and its CUDA
RNG state dropped (:func:`_cpu_rng_tracker`): states are registered as upstream registers them
(``model_parallel_cuda_manual_seed``, called by :func:`areal_npu.train.megatron.runtime.init_parallel_state`
on every device), and a fork of a state never registered fails as it does on a GPU -- the shim
does not hide a missing registration. Forking draws nothing: exact because the engine's dropout is 0.

Activation recomputation (``train.gradient_checkpointing``): Megatron's ``CheckpointFunction``
saves the CUDA RNG state in its forward and restores it around the recomputation in its backward
(``_get_cuda_rng_state`` / ``_set_cuda_rng_state``); on a CPU-only build the first raises and the
second would queue the state for a CUDA that never starts. The RNG shim (:data:`CPU_RNG_SHIMS`,
:func:`cuda_rng_is_the_cpu_generator`) runs its forward and backward with those two reading and
setting the CPU generator instead -- the generator the recomputed CPU code draws from, so the
recomputation sees the forward's random stream (none is drawn anyway: dropout is 0). On the NPU
MindSpeed's adaptor maps these CUDA RNG calls to the NPU (not run here).

Pipeline parallelism: Megatron's ``P2PCommunicator`` allocates its receive buffers (and, with
micro-batches of varying length, the shape messages) on ``torch.cuda.current_device()`` and calls
``torch.cuda.synchronize()`` after exchanging shapes; :data:`CPU_P2P_SHIMS` run those two methods
with the CPU as the current device and the synchronize a no-op (:func:`cpu_pipeline_p2p`). The
sends and receives themselves are gloo's ``isend`` / ``irecv`` / ``batch_isend_irecv``. The 1F1B
schedule allocates one counter with the literal ``device="cuda"`` (:data:`CPU_SCHEDULE_SHIMS`,
:func:`cuda_zeros_on_the_cpu`).

What is deliberately *not* shimmed, because the Megatron engine never reaches it on the CPU:

- the training RNG tracker's CUDA state: used by weight initialisation on the device (we
  build with ``use_cpu_initialization`` and load HF weights, no random init) and by dropout (0);
  recomputation saves the CPU tracker's states through the tracker's own API;
- ``CheckpointWithoutOutput`` (selective recomputation of single modules): the engine uses full
  recomputation only;
- the packed-sequence refusal of the non-TE ``DotProductAttention``: the engine's layer spec uses
  its own core attention (:class:`areal_npu.train.megatron.attention.PackedCoreAttention`, our
  packed kernel), so Megatron's local attention never runs;
- ``MTPLossLoggingHelper``: only ``GPTModel._postprocess`` calls it with labels; the engine
  computes its losses itself (chunked, vocab-parallel).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading

import torch

__all__ = [
    "CPU_DEVICE_SHIMS",
    "CPU_P2P_SHIMS",
    "CPU_RNG_SHIMS",
    "CPU_SCHEDULE_SHIMS",
    "apply_cpu_patches",
    "cpu_pipeline_p2p",
    "cuda_device_answers_cpu",
    "cuda_rng_is_the_cpu_generator",
    "cuda_zeros_on_the_cpu",
    "unpatched",
]

#: (module, attribute path, why): upstream functions that allocate on ``torch.cuda.current_device()``.
CPU_DEVICE_SHIMS: tuple[tuple[str, str, str], ...] = (
    (
        "megatron.core.models.common.embeddings.rotary_pos_embedding",
        "RotaryEmbedding.get_emb",
        # Moves ``inv_freq`` to ``torch.cuda.current_device()`` on the first forward whenever it is
        # on the CPU: every RoPE model (Qwen3) fails on a CPU-only build at its first forward.
        "rotary inv_freq is moved to torch.cuda.current_device() on first use",
    ),
    (
        "megatron.core.tensor_parallel.mappings",
        "_gather_along_last_dim",
        # Allocates the all-gather output on torch.cuda.current_device(). Reached when TP is larger
        # than the KV heads: SelfAttention all-gathers the fused QKV output over TP (forward).
        "the TP all-gather output is allocated on torch.cuda.current_device()",
    ),
    (
        "megatron.core.tensor_parallel.mappings",
        "_reduce_scatter_along_first_dim",
        # Same allocation: the backward of that all-gather is a reduce-scatter
        # (_reduce_scatter_along_last_dim calls this one), which gloo runs in torch >= 2.13.
        "the TP reduce-scatter output is allocated on torch.cuda.current_device()",
    ),
    (
        "megatron.core.tensor_parallel.mappings",
        "_gather_along_first_dim",
        # Sequence parallelism: the backward of the embedding's reduce-scatter and the gather of the
        # decoder's output before the vocabulary-parallel head allocate here.
        "the sequence-parallel all-gather output is allocated on torch.cuda.current_device()",
    ),
    (
        "megatron.core.utils",
        "GlobalMemoryBuffer.get_tensor",
        # Sequence parallelism: ColumnParallelLinear all-gathers its input into this shared buffer.
        "the shared all-gather buffer is allocated on torch.cuda.current_device()",
    ),
    (
        "megatron.core.tensor_parallel.layers",
        "LinearWithGradAccumulationAndAsyncCommunication.backward",
        # Sequence parallelism: the input gradient's reduce-scatter output is allocated there.
        "the sequence-parallel reduce-scatter of the input gradient is allocated on torch.cuda.current_device()",
    ),
)

P2P = "megatron.core.pipeline_parallel.p2p_communication"

#: (module, attribute path, why): pipeline-parallel send/receive; they run inside
#: :func:`cpu_pipeline_p2p` (the current device is the CPU, and a CUDA synchronize is a no-op).
CPU_P2P_SHIMS: tuple[tuple[str, str, str], ...] = (
    (
        P2P,
        "P2PCommunicator._communicate_shapes",
        # Micro-batches of varying length (variable_seq_lengths): the shapes travel first, in
        # tensors allocated on torch.cuda.current_device(), then torch.cuda.synchronize() guards
        # batch_isend_irecv (a CUDA race; gloo's wait() has completed the exchange on the CPU).
        "the shape exchange allocates on torch.cuda.current_device() and calls torch.cuda.synchronize()",
    ),
    (
        P2P,
        "P2PCommunicator._communicate",
        # The receive buffers of activations and their gradients.
        "the activation receive buffers are allocated on torch.cuda.current_device()",
    ),
)

SCHEDULES = "megatron.core.pipeline_parallel.schedules"

#: (module, attribute path, why): the pipeline schedule; it runs inside :func:`cuda_zeros_on_the_cpu`.
CPU_SCHEDULE_SHIMS: tuple[tuple[str, str, str], ...] = (
    (
        SCHEDULES,
        "forward_backward_pipelining_without_interleaving",
        # Counts the loss's tokens in torch.zeros([], dtype=torch.int, device="cuda"): a literal
        # device string, which the current_device shim cannot redirect.
        'the 1F1B schedule allocates its token counter with torch.zeros(..., device="cuda")',
    ),
)

RANDOM = "megatron.core.tensor_parallel.random"

#: (module, attribute path, why): upstream functions that get/set the CUDA RNG state; they run
#: inside :func:`cuda_rng_is_the_cpu_generator`. One shim: the two halves of ``CheckpointFunction``.
CPU_RNG_SHIMS: tuple[tuple[str, str, str], ...] = (
    (
        RANDOM,
        "CheckpointFunction.forward",
        "recomputation saves the CUDA RNG state (torch.cuda.get_rng_state)",
    ),
    (RANDOM, "CheckpointFunction.backward", "recomputation restores the CUDA RNG state around the re-run"),
)

_ORIGINAL = "_areal_npu_original"
_lock = threading.RLock()
_applied: list[str] = []


@contextlib.contextmanager
def cuda_device_answers_cpu():
    """While active, ``torch.cuda.current_device()`` returns ``"cpu"`` (a valid ``device=`` value);
    only used on CPU-only builds, where the real call can only raise."""
    with _lock:
        original = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"
        try:
            yield
        finally:
            torch.cuda.current_device = original


@contextlib.contextmanager
def cpu_pipeline_p2p():
    """While active, ``torch.cuda.current_device()`` returns ``"cpu"`` and ``torch.cuda.synchronize()``
    does nothing (CPU work and gloo's completed requests have nothing to wait for)."""
    with _lock, cuda_device_answers_cpu():
        original = torch.cuda.synchronize
        torch.cuda.synchronize = lambda device=None: None
        try:
            yield
        finally:
            torch.cuda.synchronize = original


@contextlib.contextmanager
def cuda_zeros_on_the_cpu():
    """While active, ``torch.zeros(..., device="cuda")`` allocates on the CPU (any other call is
    unchanged); only used on CPU-only builds, where a CUDA allocation can only raise."""

    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return original(*args, **kwargs)

    with _lock:
        original = torch.zeros
        torch.zeros = zeros
        try:
            yield
        finally:
            torch.zeros = original


@contextlib.contextmanager
def cuda_rng_is_the_cpu_generator():
    """While active, Megatron's ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` get and set the CPU
    generator's state; only used on CPU-only builds, where the real ones cannot work."""
    from megatron.core.tensor_parallel import random as mrandom

    with _lock:
        original = mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state
        mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
            torch.get_rng_state()
        )
        mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(
            new_state
        )
        try:
            yield
        finally:
            mrandom._get_cuda_rng_state, mrandom._set_cuda_rng_state = original


def _resolve(module_name: str, path: str):
    module = importlib.import_module(module_name)
    owner = module
    parts = path.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part)
    return module, owner, parts[-1]


def unpatched(module_name: str, path: str):
    """The upstream function behind a shim (itself when not patched)."""
    _, owner, name = _resolve(module_name, path)
    fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    return getattr(fn, _ORIGINAL, fn)


def _wrap(fn, context=cuda_device_answers_cpu):
    @functools.wraps(fn)
    def on_cpu(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    setattr(on_cpu, _ORIGINAL, fn)
    return on_cpu


def _rebind_importers(module_name: str, name: str, old, new) -> None:
    """Modules that did ``from <module> import <name>`` hold their own reference: update those."""
    import sys

    for mod in list(sys.modules.values()):
        if mod is None or not getattr(mod, "__name__", "").startswith("megatron"):
            continue
        if mod.__dict__.get(name) is old:
            setattr(mod, name, new)


def apply_cpu_patches() -> list[str]:
    """Apply every shim in :data:`CPU_DEVICE_SHIMS` (idempotent); returns their paths.

    Refuses to run where CUDA exists: there the upstream code is right as it is."""
    if torch.cuda.is_available():
        raise RuntimeError("the Megatron CPU shims are for CPU-only torch builds; CUDA is available here")
    shims = [(shim, cuda_device_answers_cpu) for shim in CPU_DEVICE_SHIMS]
    shims += [(shim, cuda_rng_is_the_cpu_generator) for shim in CPU_RNG_SHIMS]
    shims += [(shim, cpu_pipeline_p2p) for shim in CPU_P2P_SHIMS]
    shims += [(shim, cuda_zeros_on_the_cpu) for shim in CPU_SCHEDULE_SHIMS]
    with _lock:
        for (module_name, path, _why), context in shims:
            key = f"{module_name}.{path}"
            if key in _applied:
                continue
            _, owner, name = _resolve(module_name, path)
            current = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            if hasattr(current, _ORIGINAL):
                _applied.append(key)
                continue
            patched = _wrap(current, context)
            setattr(owner, name, patched)
            if not isinstance(owner, type):
                _rebind_importers(module_name, name, current, patched)
            _applied.append(key)
        _cpu_rng_tracker()
        return list(_applied)


def _cpu_rng_tracker() -> None:
    """Install, once per process, Megatron's training RNG tracker without a CUDA RNG state: ``add``
    keeps upstream's checks (a seed or a name used twice) and records the state, ``fork`` refuses a
    state never added (upstream's error) and otherwise leaves every generator alone. Installed
    through the tracker module's own globals, the ones ``initialize_rng_tracker`` sets (it has no
    class argument); ``initialize_rng_tracker(force_reset=True)`` puts upstream's back."""
    from megatron.core.tensor_parallel import random as mrandom

    if type(mrandom._CUDA_RNG_STATE_TRACKER).__name__ == "CpuRNGStatesTracker":
        return

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self.states_[name] = torch.tensor(seed)  # stands for the state a GPU would keep

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            yield

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
