"""The Megatron-Core 0.16.1 train engine (:mod:`.engine`): packed THD, TP / CP / DP, decoupled PPO.

Modules: :mod:`.runtime` (imports Megatron: MindSpeed's adaptor first on the NPU, the CPU shims of
:mod:`areal_npu.compat.megatron` on the CPU), :mod:`.shape` (the shape facts of an HF config),
:mod:`.specs` (the local layer spec), :mod:`.model` (``GPTModel`` from an HF Qwen3 config;
Qwen3.5 refused off the NPU), :mod:`.hybrid` (Qwen3.5's Gated DeltaNet layers), :mod:`.attention`
(the layer spec's core attention: our packed kernel, all-gather context parallelism),
:mod:`.packing` (our micro-batches as ``PackedSeqParams`` and zigzag shares), :mod:`.logprobs`
(chunked log-probs on the vocab-sharded head), :mod:`.convert` (HF <-> Megatron weights),
:mod:`.mtp` (the MTP layer), :mod:`.checkpoint` (checkpoints and the bucketed export),
:mod:`.config` (the ``train.megatron`` layout and what the engine refuses). The engine's scaffolding
(cap, packing, the step's counts, loss and stats) is :class:`areal_npu.train.base.TrainEngineBase`,
shared with the FSDP2 engine; losses are the shared objects of :mod:`areal_npu.train.losses`.

What ran where: everything here ran on the CPU over gloo (1 and 2 ranks: TP=2, CP=2, DP=2). The
NPU path (MindSpeed, HCCL, ``npu_fusion_attention`` through the packed kernel) and CUDA are
written but have not run.

Nothing here imports Megatron at import time: on the NPU, MindSpeed's adaptor must come first.
"""
