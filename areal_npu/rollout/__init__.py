"""Rollouts through vLLM with MTP speculative decoding.

* ``config``    -- :class:`RolloutConfig` (validated before anything starts); its ``spec`` is
  :class:`areal_npu.speculation.config.SpecConfig`
* ``server``    -- the engine process (``python -m areal_npu.rollout.server``): vLLM's OpenAI app + ``/areal/*``
* ``engine_state`` -- what one engine's routes share: weight version, the open update, partly loaded
  weights, the draft length it runs
* ``generation_routes``, ``weight_routes``, ``spec_routes`` -- the ``/areal`` routes by concern:
  generate / pause / resume; versioned weight updates (RPC buckets, broadcast); draft length and
  acceptance counters
* ``request_body``, ``route_errors`` -- the fields each ``/areal`` route accepts, and how a refusal
  answers (400 naming the field, or what vLLM refused)
* ``parent_watch`` -- the engine's process group dies with the trainer that launched it
* ``client``    -- :class:`RolloutClient`: async, token ids in / ids + behaviour log-probs + versions out
* ``buckets``, ``worker_ext``, ``transports``, ``collective`` -- versioned weight sync of the policy and
  the MTP drafter: RPC buckets, or the hccl / nccl / gloo broadcast; restarts and bounded retries
* ``guard``     -- the run's secret on every engine route, and request body limits

Speculation (its config, acceptance metrics, runtime draft length, adaptive policy) is
:mod:`areal_npu.speculation`, below this package; test oracles and the near-oracle MTP head are :mod:`areal_npu.testing`.

Submodules import vLLM / httpx lazily; importing this package is cheap.
"""
