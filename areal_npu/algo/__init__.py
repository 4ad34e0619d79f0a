"""RL algorithms as pure tensor functions.

advantages  — GRPOConfig, GRPO / Dr.GRPO group advantages, broadcast to response tokens
ppo         — PPOConfig, clipped surrogate (clip-higher, dual clip), decoupled PPO loss + stats
aggregation — token-mean / seq-mean with global denominators, KL estimators k1/k2/k3
guard       — non-finite guard for a step's inputs
segments    — per-sequence reductions on packed (THD) tensors
stats       — masked statistics for logs
"""
