"""Rollouts through vLLM with MTP speculative decoding.

* ``config``    -- :class:`RolloutConfig` / :class:`SpecConfig` (validated before anything starts)
* ``launcher``  -- :class:`EngineProcess`: one vLLM engine process group each, health-checked, restarted, no orphans
* ``server``    -- the engine process (``python -m areal_npu.rollout.server``): vLLM's OpenAI app + ``/areal/*``
* ``request_body`` -- the fields each ``/areal`` route accepts (bad bodies answer 400 naming the field)
* ``parent_watch`` -- the engine's process group dies with the trainer that launched it
* ``client``    -- :class:`RolloutClient`: async, token ids in / ids + behaviour log-probs + versions out
* ``buckets``, ``worker_ext``, ``transports``, ``collective`` -- versioned weight sync of the policy and
  the MTP drafter: RPC buckets, or the hccl / nccl / gloo broadcast; restarts and bounded retries
* ``guard``     -- the run's secret on every engine route, and request body limits

Speculation (acceptance metrics, runtime draft length, adaptive policy) is :mod:`areal_npu.spec`;
test oracles and the near-oracle MTP head are :mod:`areal_npu.testing`.

Submodules import vLLM / httpx lazily; importing this package is cheap.
"""
