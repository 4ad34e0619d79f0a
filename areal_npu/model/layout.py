"""The two checkpoint layouts of Qwen3.5/3.6, and the one place that converts between them.

``published``: how Qwen3.5/3.6 ship and the only Qwen3.5 layout vLLM 0.23 serves. One multimodal
checkpoint: outer ``config.json`` (``architectures: ["Qwen3_5ForConditionalGeneration"]``,
``text_config``, ``vision_config``); weights ``model.language_model.*`` (the text model),
``model.visual.*`` (the vision tower), ``lm_head.*`` and ``mtp.*``; a ``preprocessor_config.json``.

``text``: a text-only ``Qwen3_5ForCausalLM`` checkpoint (``model.*``, ``lm_head.*``, ``mtp.*``).

Training always runs the text causal LM built from the checkpoint's text config, with the
published names renamed (``model.language_model.`` -> ``model.``). Why not the VL class: batches
are text only, and on text the VL class computes exactly the text model (its language model with
3-D rotary positions that are equal in all three sections); the text class is what the engine's
FSDP2 wrapping, packed attention, Gated DeltaNet segment reset and MTP head were built and tested
on, and the vision tower would only add frozen FSDP units and parameters to the optimizer's
bookkeeping. The vision tower is instead carried through untouched: read once at load (kept in
memory, so a later checkpoint does not depend on the source directory still existing), written
back bit for bit on every save, and synced only when asked (``kind="vision"``).

Saving writes the layout the checkpoint came from: the outer config with ``architectures`` (its
``text_config`` is the very object the text model was built from, so ``mtp_num_hidden_layers``
set in training lands there), the checkpoint names, the vision tower and the processor files.
Every floating tensor is written in the dtype the checkpoint's ``config.json`` declares
(:func:`declared_dtype`, read when the checkpoint was opened, before loading in fp32 rewrites the
live config's ``dtype``): a published Qwen3.5/3.6 declares ``bfloat16``, so its export is bf16 (the
fp32 masters rounded to nearest, half the bytes), and vLLM, which loads the policy, its ``mtp.*``
drafter and an EAGLE-3 drafter in that one model dtype, holds exactly what was written; a checkpoint
declaring ``float32`` (the tiny test models) is exported in fp32. The saved ``config.json`` declares
the dtype written. Integer tensors are written as they are.
Export names for weight sync come from :meth:`CheckpointLayout.checkpoint_name`: the names the
engine's model loads (vLLM's ``Qwen3_5ForConditionalGeneration.load_weights`` maps
``model.language_model.*`` / ``model.visual.*`` / ``lm_head.*``; its ``Qwen3_5MTP`` drafter takes
``mtp.*``).

A whole checkpoint -- policy and MTP head -- is loaded (:func:`load_for_training`, or
:func:`load_model_with_mtp` for the text layout alone) and saved (:func:`save_model_with_mtp`) here;
the head's own tensors come from :mod:`areal_npu.model.mtp_checkpoint`, which imports nothing of
this module.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from areal_npu.model.hf_shards import DEFAULT_MAX_SHARD_BYTES
from areal_npu.model.mtp import MTPConfig, Qwen35MTP, mtp_state_dict
from areal_npu.model.mtp_checkpoint import INDEX_NAME, MTP_SHARD_NAME, attach_mtp

__all__ = [
    "PUBLISHED",
    "PUBLISHED_TEXT_PREFIX",
    "TEXT",
    "VISION_PREFIX",
    "CheckpointLayout",
    "config_and_layout",
    "declared_dtype",
    "detect_layout",
    "load_for_training",
    "load_model_with_mtp",
    "read_checkpoint_tensors",
    "save_model_with_mtp",
]

TEXT = "text"
PUBLISHED = "published"
PUBLISHED_TEXT_PREFIX = "model.language_model."
TRAIN_TEXT_PREFIX = "model."
VISION_PREFIX = "model.visual."
#: Files beside the weights that a published checkpoint needs to load as a VL model in vLLM
#: (its Qwen3.5 processor is built even with images switched off); carried through saves.
PROCESSOR_FILES = (
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


def detect_layout(model_dir: str | Path) -> str:
    """``published`` when ``config.json`` is the multimodal outer config (has ``text_config``), else ``text``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return PUBLISHED if isinstance(config.get("text_config"), dict) else TEXT


def declared_dtype(config) -> torch.dtype | None:
    """The weights' dtype a checkpoint config declares (``dtype``, formerly ``torch_dtype``): its text
    config's, else the outer config's; ``None`` when neither says (or says ``auto``)."""
    for cfg in (config.get_text_config(), config):
        value = getattr(cfg, "dtype", None)
        if value is None or value == "auto":
            continue
        dtype = (
            value
            if isinstance(value, torch.dtype)
            else getattr(torch, str(value).removeprefix("torch."), None)
        )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"config.json declares dtype {value!r}: not a floating-point torch dtype")
        return dtype
    return None


def read_checkpoint_tensors(model_dir: str | Path, keep=lambda name: True) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files whose name passes ``keep``."""
    from safetensors import safe_open

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                if keep(key):
                    tensors[key] = f.get_tensor(key)
    return tensors


@dataclass
class CheckpointLayout:
    """Which layout a checkpoint has, and what a save needs beyond the trained weights.

    ``config``: the checkpoint's own config (the outer ``Qwen3_5Config`` for ``published``).
    ``carried``: tensors saved untouched (the vision tower), under checkpoint names.
    ``files``: processor files copied beside the weights.
    ``dtype``: the dtype the checkpoint's config declared when it was opened (:func:`declared_dtype`),
    which a save writes floating tensors in; ``None``: the dtype the saved config declares then.
    """

    kind: str = TEXT
    config: object = None
    carried: dict[str, torch.Tensor] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.kind not in (TEXT, PUBLISHED):
            raise ValueError(f"layout must be {TEXT!r} or {PUBLISHED!r}, got {self.kind!r}")

    def checkpoint_name(self, training_name: str) -> str:
        """Training name (text causal LM + ``mtp.*``) -> the name in this layout's checkpoint."""
        if self.kind == PUBLISHED and training_name.startswith(TRAIN_TEXT_PREFIX):
            return PUBLISHED_TEXT_PREFIX + training_name[len(TRAIN_TEXT_PREFIX) :]
        return training_name

    def training_name(self, checkpoint_name: str) -> str | None:
        """Checkpoint name -> training name; ``None`` for tensors training does not hold (vision)."""
        if self.kind == TEXT:
            return checkpoint_name
        if checkpoint_name.startswith(PUBLISHED_TEXT_PREFIX):
            return TRAIN_TEXT_PREFIX + checkpoint_name[len(PUBLISHED_TEXT_PREFIX) :]
        if checkpoint_name.startswith(VISION_PREFIX):
            return None
        return checkpoint_name

    def checkpoint_tensors(
        self, named: Iterable[tuple[str, torch.Tensor]], with_carried: bool = True
    ) -> dict[str, torch.Tensor]:
        """Training-named tensors renamed for this layout, plus the carried ones."""
        out = {self.checkpoint_name(n): t for n, t in named}
        if with_carried:
            out.update(self.carried)
        return out

    def save(
        self,
        out_dir: str | Path,
        named: Iterable[tuple[str, torch.Tensor]],
        text_config,
        tokenizer=None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> Path:
        """Write ``config.json``, the weights (training-named tensors renamed, carried ones added;
        floating ones in the checkpoint's dtype, ``self.dtype`` or else the config's; streamed one
        tensor at a time into shards of at most ``max_shard_bytes``,
        :mod:`areal_npu.model.hf_shards`) and the processor files into ``out_dir``."""
        from areal_npu.model.hf_shards import ShardedSafetensorsWriter

        out = Path(out_dir)
        config = self.config if self.kind == PUBLISHED else text_config
        if self.kind == PUBLISHED and config.text_config is not text_config:
            raise ValueError(
                "the trained text config is not the checkpoint's text_config (load with load_for_training)"
            )
        dtype = self.dtype if self.dtype is not None else declared_dtype(config)

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor

        writer = ShardedSafetensorsWriter(out, max_shard_bytes)
        for name, tensor in named:
            writer.add(self.checkpoint_name(name), cast(tensor))
        for name, tensor in self.carried.items():
            writer.add(name, cast(tensor))
        writer.finish()
        _save_config(config, dtype, out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        for name, data in self.files.items():
            (out / name).write_bytes(data)
        return out


def _save_config(config, dtype: torch.dtype | None, out: Path) -> None:
    """``config.save_pretrained(out)`` declaring ``dtype`` (the text config's ``dtype``, and the outer
    config's where it declares one), the live config left as it was (training's text config says
    what the model was built in)."""
    declaring = [config.get_text_config()]
    if config is not declaring[0] and getattr(config, "dtype", None) is not None:
        declaring.append(config)
    before = [c.dtype for c in declaring]
    try:
        if dtype is not None:
            for c in declaring:
                c.dtype = dtype
        config.save_pretrained(out)
    finally:
        for c, value in zip(declaring, before):
            c.dtype = value


def _load_published_text_model(model_dir: Path, config, dtype: torch.dtype):
    """The text causal LM from ``config.text_config`` with the ``model.language_model.*`` weights
    (transformers' own loader, renaming on the fly; it skips ``model.visual.*`` and ``mtp.*``)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        config=config.text_config,
        dtype=dtype,
        key_mapping={"^" + PUBLISHED_TEXT_PREFIX.replace(".", r"\."): TRAIN_TEXT_PREFIX},
        output_loading_info=True,
    )
    problems = {k: v for k, v in info.items() if k in ("missing_keys", "mismatched_keys") and v}
    if problems:
        raise ValueError(f"{model_dir}: published checkpoint does not match its text_config: {problems}")
    # one config object: what training sets on the text model (mtp_num_hidden_layers) is saved
    config.text_config = model.config
    return model


def _published_layout(model_dir: Path, config) -> CheckpointLayout:
    carried = read_checkpoint_tensors(model_dir, keep=lambda n: n.startswith(VISION_PREFIX))
    files = {
        name: (model_dir / name).read_bytes() for name in PROCESSOR_FILES if (model_dir / name).is_file()
    }
    return CheckpointLayout(PUBLISHED, config, carried, files, declared_dtype(config))


def config_and_layout(model_dir: str | Path):
    """``(text config, CheckpointLayout)`` of a checkpoint in either layout, without loading its
    weights (engines that read only their shards: :mod:`areal_npu.model.safetensors_reader`). For a
    published one the text config is the very ``text_config`` object of the layout's config."""
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir))
    if detect_layout(model_dir) == TEXT:
        return config, CheckpointLayout(TEXT, dtype=declared_dtype(config))
    return config.text_config, _published_layout(model_dir, config)


def load_for_training(model_dir: str | Path, mtp_cfg, dtype: torch.dtype = torch.float32):
    """``(text causal LM, MTP head or None, CheckpointLayout)`` from a checkpoint in either layout."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(str(model_dir))  # declared dtype: before loading rewrites it
    if detect_layout(model_dir) == TEXT:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        layout = CheckpointLayout(TEXT, dtype=declared_dtype(config))
        return model, attach_mtp(model, mtp_cfg, model_dir), layout
    layout = _published_layout(model_dir, config)
    model = _load_published_text_model(model_dir, config, dtype)
    return model, attach_mtp(model, mtp_cfg, model_dir), layout


def load_model_with_mtp(model_dir: str | Path, cfg: MTPConfig, dtype: torch.dtype = torch.float32, **kwargs):
    """``(model, mtp or None)``: transformers for the policy, :func:`attach_mtp` for the head.
    Text-layout checkpoints only: a published (multimodal) one loads with
    :func:`load_for_training`, which also returns the layout to save it in."""
    from transformers import AutoModelForCausalLM

    if detect_layout(model_dir) == PUBLISHED:
        raise ValueError(
            f"{model_dir} is a published (multimodal) Qwen3.5 checkpoint: load it with "
            "areal_npu.model.layout.load_for_training, so that saves keep its layout"
        )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kwargs)
    return model, attach_mtp(model, cfg, model_dir)


def save_model_with_mtp(
    model, mtp: Qwen35MTP | None, out_dir: str | Path, tokenizer=None, layout=None
) -> Path:
    """``save_pretrained`` plus the ``mtp.*`` weights: merged into a single ``model.safetensors``,
    or as ``model-mtp.safetensors`` listed in the shard index. Sets ``mtp_num_hidden_layers``.
    With a published ``layout`` (from :func:`load_for_training`) the text
    model is written back into that layout instead (one ``model.safetensors``)."""
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if mtp is not None:
        model.config.get_text_config().mtp_num_hidden_layers = mtp.num_layers
    if layout is not None and layout.kind == PUBLISHED:
        named = [(k, v.detach().to("cpu")) for k, v in model.state_dict().items()]
        named += [(k, v.to("cpu")) for k, v in (mtp_state_dict(mtp) if mtp is not None else {}).items()]
        return layout.save(out, named, model.config, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if mtp is None:
        return out
    head = {k: v.to("cpu") for k, v in mtp_state_dict(mtp).items()}
    index = out / INDEX_NAME
    if index.is_file():
        data = json.loads(index.read_text())
        save_file(head, str(out / MTP_SHARD_NAME), metadata={"format": "pt"})
        data["weight_map"].update({k: MTP_SHARD_NAME for k in head})
        index.write_text(json.dumps(data, indent=2, sort_keys=True))
    else:
        single = out / "model.safetensors"
        tensors = load_file(str(single))
        tensors.update(head)
        save_file(tensors, str(single), metadata={"format": "pt"})
    return out
