"""Independent oracles for the rollout engine, computed with transformers (no vLLM code involved).

* :func:`sequence_logprobs` -- log p(token | prefix) of given completions, optionally at a temperature
  and under top-k / top-p (behaviour log-prob check, the trainer's log-probs).
* :func:`greedy` -- argmax continuation.
* :func:`exact_joint` -- the exact distribution of the first ``m`` sampled tokens at temperature 1,
  enumerated over every prefix with probability above ``min_prob`` (the rest lumped together).
* :func:`random_prompts` -- reproducible byte prompts for the engine tests.
"""

from __future__ import annotations

import torch


def load_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@torch.no_grad()
def sequence_logprobs(
    model,
    prompt: list[int],
    completion: list[int],
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> torch.Tensor:
    """log p(completion token | prefix) under the distribution sampled from: the logits divided by
    ``temperature``, then only the ``top_k`` largest (0: all) and the smallest most-probable set
    whose mass reaches ``top_p`` kept, renormalised."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].double()[len(prompt) - 1 : -1] / temperature
    logp = torch.log_softmax(sampled_filter(logits, top_p, top_k), dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]


def sampled_filter(logits: torch.Tensor, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """``logits`` [N, V] with every token outside the top-k / top-p set at -inf: top-k keeps the
    ``top_k`` largest; top-p then keeps, in descending order of probability, each token whose
    predecessors' mass is still below ``top_p`` (so at least the most probable one)."""
    out = logits.clone()
    if top_k > 0:
        kth = out.topk(top_k, dim=-1).values[:, -1:]
        out[out < kth] = float("-inf")
    if top_p < 1.0:
        probs, order = torch.softmax(out, dim=-1).sort(dim=-1, descending=True)
        before = probs.cumsum(dim=-1) - probs
        drop = torch.zeros_like(out, dtype=torch.bool).scatter(-1, order, before >= top_p)
        out[drop] = float("-inf")
    return out


@torch.no_grad()
def greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def next_token_probs(model, prefixes: list[list[int]]) -> torch.Tensor:
    """[len(prefixes), V] next-token probabilities (prefixes of equal length, batched)."""
    logits = model(input_ids=torch.tensor(prefixes)).logits[:, -1].double()
    return torch.softmax(logits, dim=-1)


@torch.no_grad()
def exact_joint(model, prompt: list[int], m: int, min_prob: float = 1e-4) -> dict[tuple[int, ...], float]:
    """{(t1..tm): probability} for every continuation above ``min_prob``; key ``()`` holds the remainder."""
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(m):
        keys = list(frontier)
        probs = next_token_probs(model, [prompt + list(k) for k in keys])
        nxt: dict[tuple[int, ...], float] = {}
        for key, row in zip(keys, probs, strict=True):
            for tok in torch.nonzero(row * frontier[key] > min_prob)[:, 0].tolist():
                nxt[key + (tok,)] = frontier[key] * float(row[tok])
        frontier = nxt
    frontier[()] = max(0.0, 1.0 - sum(frontier.values()))
    return frontier


def chi2_sf(x: float, df: int) -> float:
    """P(chi2_df >= x), via the regularised upper incomplete gamma function."""
    return float(
        torch.special.gammaincc(
            torch.tensor(df / 2, dtype=torch.float64), torch.tensor(x / 2, dtype=torch.float64)
        )
    )


def cells(expected: dict, min_expected: float) -> list:
    """Keys of ``expected`` whose expected count is at least ``min_expected``; the rest get pooled."""
    return [k for k, v in sorted(expected.items(), key=lambda kv: -kv[1]) if k != () and v >= min_expected]


def chi2_two_sample(counts_a: dict, counts_b: dict, keep: list) -> tuple[float, int]:
    """Pearson chi-square test of homogeneity on the ``keep`` cells plus one pooled cell. (p-value, df)."""
    rows = []
    for counts in (counts_a, counts_b):
        total = sum(counts.values())
        kept = [counts.get(k, 0) for k in keep]
        rows.append(kept + [total - sum(kept)])
    table = torch.tensor(rows, dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    df = table.shape[1] - 1
    return chi2_sf(stat, df), df


def chi2_goodness_of_fit(counts: dict, probs: dict, keep: list) -> tuple[float, int]:
    """Pearson chi-square goodness of fit of ``counts`` to the exact ``probs``. (p-value, df)."""
    total = sum(counts.values())
    observed = [counts.get(k, 0) for k in keep]
    p = [probs[k] for k in keep]
    observed.append(total - sum(observed))
    p.append(1.0 - sum(p))
    obs = torch.tensor(observed, dtype=torch.float64)
    exp = torch.tensor(p, dtype=torch.float64) * total
    stat = float(((obs - exp) ** 2 / exp).sum())
    return chi2_sf(stat, len(observed) - 1), len(observed) - 1


def random_prompts(count: int, seed: int, min_len: int = 4, max_len: int = 12) -> list[list[int]]:
    """``count`` prompts of random bytes, lengths in ``[min_len, max_len)`` (reproducible per seed)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(min_len, max_len))] for _ in range(count)]
