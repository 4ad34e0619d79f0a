"""Pipeline parallelism in the Megatron engine: Megatron-Core's 1F1B schedule over packed micro-batches.

With ``train.megatron.pp_size`` > 1 each rank builds one stage of the model
(:class:`areal_npu.train.megatron.convert.Stage`: its layers; the embedding on the first stage, the
final norm and the output layer on the last). :func:`run_pipeline` hands the engine's packed
micro-batches to Megatron-Core's ``forward_backward_pipelining_without_interleaving`` (warm-up,
one-forward-one-backward, cool-down): every stage runs its decoder layers on the activations the
previous stage sent (shapes first: packed micro-batches differ in length, ``variable_seq_lengths``)
and sends the gradient of its input back. The last stage applies ``head`` to the final-norm hidden
states (and the RoPE table its decoder used, which the MTP layer there reuses) -- the engine's
chunked vocab-parallel log-probs and its loss, globally normalised already, so the schedule leaves
it unscaled (``calculate_per_token_loss``; the token count we hand it is 1).

What ``head`` returns beside the loss (log-probs, stats) exists on the last stage only;
:func:`from_last_stage` broadcasts it to every stage, so the engine's methods answer the same on
every rank; :func:`stream_from_last_stage` does so for the MTP head's tensors, one at a time. Gradients stay where their parameters live: each stage's optimizer steps its own layers
(the norm used for clipping is summed over the stages, :mod:`.grads`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from areal_npu.train.megatron.model import decoder_hidden_states

__all__ = ["from_last_stage", "run_pipeline", "stream_from_last_stage"]


def run_pipeline(engine, mbs: Sequence, head: Callable, forward_only: bool) -> list:
    """Run every micro-batch of ``mbs`` through the stages (and back unless ``forward_only``);
    ``head(hidden [t, H], mb, rotary) -> (loss scalar, result)`` runs on the last stage. Returns the
    results in micro-batch order, on every rank of the pipeline. Collective over the pipeline group."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def loss_func(mb, rotary, hidden):
        loss, result = head(hidden[:, 0], mb, rotary)
        return loss, torch.ones((), dtype=torch.int), result

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        hidden, rotary = decoder_hidden_states(
            model, mb.input_ids, mb.position_ids, mb.params, with_rotary=True, squeeze=False
        )
        return hidden, functools.partial(loss_func, mb, rotary)

    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[engine.module],
        num_microbatches=len(mbs),
        seq_length=max((len(mb.input_ids) for mb in mbs), default=1),
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return from_last_stage(list(results), engine.pp_group)


def from_last_stage(obj, pp_group):
    """``obj`` as the last pipeline stage has it, on every stage (tensors come back on the CPU)."""
    size = dist.get_world_size(pp_group)
    if size == 1:
        return obj
    box = [_to_cpu(obj) if dist.get_rank(pp_group) == size - 1 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(pp_group, size - 1), group=pp_group)
    return box[0]


def stream_from_last_stage(make_pairs: Callable, pp_group, device) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, CPU tensor)`` pairs ``make_pairs()`` yields on the last pipeline stage (called
    there only), on every stage: one tensor at a time, its name and shape broadcast first (through
    ``device``: HCCL / NCCL move device tensors). Collective over ``pp_group``."""
    size = dist.get_world_size(pp_group)
    if size == 1:
        yield from make_pairs()
        return
    last = dist.get_rank(pp_group) == size - 1
    src = dist.get_global_rank(pp_group, size - 1)
    pairs = iter(make_pairs()) if last else None
    while True:
        item = next(pairs, None) if last else None
        head = [None if item is None else (item[0], tuple(item[1].shape), item[1].dtype)]
        dist.broadcast_object_list(head, src=src, group=pp_group)
        if head[0] is None:
            return
        name, shape, dtype = head[0]
        tensor = item[1].to(device) if last else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src, group=pp_group)
        yield name, tensor.to("cpu", copy=True)


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj
