"""An engine client answering with pre-written assistant turns, for agent tests that need no model."""

from __future__ import annotations

from areal_npu.rollout.client import GenerationResult, GenerationSample


class ScriptedEngine:
    """The client API, answering with pre-written assistant turns: the turn's tokens then <|im_end|>
    (the stop token), cut at ``max_tokens`` like an engine (finish_reason "length"). Log-probs and
    versions are made up and differ per turn and token; ``cut`` marks turns returned without the stop.
    ``requests``: every request as sent (``input_ids``, ``max_tokens``, ...); ``sent``: (output ids,
    log-probs, versions) per turn."""

    def __init__(self, tok, turns, cut=()):
        self.tok, self.turns, self.cut = tok, list(turns), set(cut)
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.requests = []
        self.sent = []

    async def generate(self, input_ids, *, max_tokens, n=1, **kwargs):
        turn = len(self.requests)
        self.requests.append({"input_ids": list(input_ids), "max_tokens": max_tokens, "n": n, **kwargs})
        ids = self.tok.encode(self.turns[turn], add_special_tokens=False)
        if turn not in self.cut:
            ids = ids + [self.im_end]
        finish = "stop"
        if len(ids) > max_tokens:
            ids, finish = ids[:max_tokens], "length"
        logprobs = [-0.25 - turn - 0.001 * i for i in range(len(ids))]
        versions = [10 + turn] * len(ids)
        self.sent.append((ids, logprobs, versions))
        return GenerationResult("r", list(input_ids), [GenerationSample(ids, logprobs, versions, finish)])
