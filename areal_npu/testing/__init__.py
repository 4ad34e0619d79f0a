"""Test and benchmark support: independent oracles and purpose-built models, outside the runtime path.

Nothing under ``areal_npu`` outside this package imports it; the tests, ``scripts/bench_*.py`` and
``scripts/smoke_rollout.py`` do. It ships with the package so that ``areal-npu bench`` and the
tests run against an installed copy.

* ``reference`` -- transformers oracles for the rollout engine (log-probs, greedy, exact joint law)
* ``synthetic`` -- a tiny Qwen3.5 + MTP checkpoint whose MTP head is a near-oracle drafter
* ``smoke``     -- a short real rollout with vLLM + MTP speculation, checked against transformers
* ``sft``       -- a standalone SFT loop for a policy and its MTP head on packed micro-batches
* ``dense``     -- a tiny dense Qwen3 with perturbed norms (the Megatron engine tests, bench_engines)
* ``memory``    -- resident-memory readings from /proc (the benchmarks' peak-RSS columns)
* ``netns``     -- two network namespaces joined by a veth: two "nodes" on one machine (root)
"""
