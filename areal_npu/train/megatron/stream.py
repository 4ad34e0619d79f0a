"""A rank's Megatron weights read straight from an HF checkpoint: only its TP shard of its pipeline
stage's tensors, one rule of :mod:`.convert` at a time, copied into the parameters the model
allocated without initialising them (``perform_initialization=False``: untouched memory is not
resident until a weight lands in it). No full model -- fp32 or bf16 -- is held on any rank.

What each rule reads (rows / columns of the HF tensors, :class:`areal_npu.model.safetensors_reader.SafetensorsReader`):
vocabulary and column-parallel weights their rows, row-parallel ones their columns, the fused
``linear_qkv`` the rows of the query groups its slice covers (a slice that cuts a group -- fewer KV
heads than TP ranks -- reads that whole group), ``linear_fc1`` its rows of gate and up, a Gated
DeltaNet tensor its heads' rows; replicated norms are read whole. Megatron-Bridge's loaders also
go one mapping at a time, but there TP rank 0 reads the whole HF tensor, splits it and scatters
the pieces (``scatter_to_tp_ranks``); here each rank reads only its own slice, so no rank holds
even one whole TP-split tensor. The slicing is the project's table (:mod:`.convert`); the tests
check it against :func:`.convert.hf_to_mcore` on the full tensors.

A *source* is anything with ``names()``, ``shape(name)``, ``dtype(name)`` and ``read(name, rows, cols, out)``:
:class:`SafetensorsReader`, or :class:`StateSource` around an in-memory state dict (the tests, and
engines built from a transformers model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from areal_npu.train.megatron import convert
from areal_npu.train.megatron.shape import GPTShape

__all__ = ["StateSource", "load_rank_weights", "rank_tensors", "read_rule"]


class StateSource:
    """A source over an in-memory ``{name: tensor}``."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.state = state

    def names(self) -> list[str]:
        return list(self.state)

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.state[name].dtype

    def read(self, name: str, rows: slice = slice(None), cols: slice | None = None, out=None) -> torch.Tensor:
        t = self.state[name][rows]
        t = t if cols is None else t[:, cols]
        return t if out is None else out.copy_(t)


def _chunk(n: int, rank: int, size: int) -> slice:
    per = n // size
    return slice(rank * per, (rank + 1) * per)


def _fused_qkv(source, names, shape: GPTShape, rank: int, tp: int, gated: bool) -> torch.Tensor:
    """This rank's rows of the fused (gated) ``linear_qkv``: the query groups its slice covers,
    fused, then cut to the slice."""
    g, d = shape.num_query_groups, shape.head_dim
    per = shape.num_heads // g
    q_rows = (2 if gated else 1) * per * d  # per group
    group_rows = q_rows + 2 * d
    a, b = rank * g * group_rows // tp, (rank + 1) * g * group_rows // tp
    g0, g1 = a // group_rows, -(-b // group_rows)
    q = source.read(names[0], slice(g0 * q_rows, g1 * q_rows))
    k = source.read(names[1], slice(g0 * d, g1 * d))
    v = source.read(names[2], slice(g0 * d, g1 * d))
    sub = dataclasses.replace(shape, num_query_groups=g1 - g0, num_heads=per * (g1 - g0))
    fused = (convert.fuse_gated_qkv if gated else convert.fuse_qkv)(q, k, v, sub)
    return fused[a - g0 * group_rows : b - g0 * group_rows]


def _gdn(source, name: str, kind: str, shape: GPTShape, rank: int, tp: int) -> torch.Tensor:
    from areal_npu.train.megatron.gdn import TP_PARTIAL, _slices, check_gdn_tp

    cfg = convert._gdn_config(shape)
    check_gdn_tp(cfg, tp)
    tensor = kind[len("gdn:") :]
    if tensor == "out_proj.weight":
        return source.read(name, cols=_chunk(source.shape(name)[1], rank, tp))
    if tensor in TP_PARTIAL:
        return source.read(name)
    return torch.cat([source.read(name, s) for s in _slices(cfg, rank, tp)[tensor]])


def read_rule(rule: convert.Rule, source, shape: GPTShape, rank: int, tp: int, name_of=str, out=None):
    """This TP rank's Megatron tensor of ``rule`` read from ``source`` (HF names mapped by
    ``name_of``: training name -> the checkpoint's); equal to :func:`.convert.shard` of the full
    tensors. ``out``: the parameter, when it has the checkpoint's dtype; plain slices are read
    straight into it (then ``out`` is returned), the others are built apart."""
    names = [name_of(h) for h in rule.hf]
    kind = rule.kind
    if kind in ("zc", "zc_head_norm"):
        return 1.0 + source.read(names[0]).float()
    if kind.startswith("gdn:"):
        return _gdn(source, names[0], kind, shape, rank, tp)
    if kind in convert.REPLICATED:
        return source.read(names[0], out=out)
    if kind in ("column", "vocab"):
        return source.read(names[0], _chunk(source.shape(names[0])[0], rank, tp), out=out)
    if kind == "row":
        return source.read(names[0], cols=_chunk(source.shape(names[0])[1], rank, tp), out=out)
    if kind in ("qkv", "gated_qkv"):
        return _fused_qkv(source, names, shape, rank, tp, gated=kind == "gated_qkv")
    if kind == "gate_up":
        rows = [_chunk(source.shape(n)[0], rank, tp) for n in names]
        if out is None:
            return torch.cat([source.read(n, r) for n, r in zip(names, rows)], dim=0)
        half = rows[0].stop - rows[0].start
        source.read(names[0], rows[0], out=out[:half])
        source.read(names[1], rows[1], out=out[half:])
        return out
    raise ValueError(f"unknown rule kind {kind!r}")


def _check_names(source, shape: GPTShape, name_of: Callable[[str], str], skip: Callable[[str], bool]) -> None:
    """Every rule's tensors are in the checkpoint, and every checkpoint tensor is some rule's."""
    wanted = {name_of(h) for h in convert.hf_names(shape)}
    missing = sorted(n for n in wanted if n not in source)
    if missing:
        raise KeyError(f"HF checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unknown = sorted(
        n for n in source.names() if n not in wanted and not skip(n) and not convert._ignored(n, shape)
    )
    if unknown:
        raise KeyError(
            f"HF tensors with no Megatron counterpart: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}"
        )


def rank_tensors(source, shape: GPTShape, rank: int = 0, tp: int = 1, stage: convert.Stage = convert.ALL,
                 name_of=str, skip=lambda name: False):  # fmt: skip
    """(Megatron name, this rank's tensor) for every rule of ``stage``, one at a time. ``skip``:
    checkpoint tensors the text model does not hold (``mtp.*``, the vision tower)."""
    _check_names(source, shape, name_of, skip)
    for rule in convert.rules(shape, stage):
        yield rule.mcore, read_rule(rule, source, shape, rank, tp, name_of)


def _direct(param: torch.Tensor, rule: convert.Rule, source, name_of) -> torch.Tensor | None:
    """``param`` where the rule's tensors can be read straight into it (host memory, same dtype,
    contiguous); on a device each tensor is read to the host and copied over."""
    same = all(source.dtype(name_of(h)) == param.dtype for h in rule.hf)
    return param if same and param.is_contiguous() and param.device.type == "cpu" else None


def load_rank_weights(module: torch.nn.Module, source, shape: GPTShape, rank: int, tp: int,
                      stage: convert.Stage = convert.ALL, name_of=str, skip=lambda name: False):  # fmt: skip
    """Copy this rank's tensors into ``module``'s parameters (every one must be filled). Returns the
    fp32 values of the parameters that hold them in a narrower dtype (bf16 training from an fp32
    checkpoint): the optimizer's masters start from those, not from the rounded parameters."""
    held = {k: v for k, v in module.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}
    exact, filled = {}, set()
    _check_names(source, shape, name_of, skip)
    with torch.no_grad():
        for rule in convert.rules(shape, stage):
            name = rule.mcore
            if name not in held:
                raise KeyError(f"Megatron state mismatch: unexpected {name}")
            param = held[name].data
            value = read_rule(
                rule, source, shape, rank, tp, name_of, out=_direct(param, rule, source, name_of)
            )
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(
                    f"{name}: model shape {tuple(param.shape)}, checkpoint gives {tuple(value.shape)}"
                )
            if value is not param:
                param.copy_(value)
            if value.dtype == torch.float32 and param.dtype != torch.float32:
                exact[name] = value
            filled.add(name)
    missing = sorted(set(held) - filled)
    if missing:
        raise KeyError(f"Megatron state mismatch: missing {missing[:5]}")
    return exact
