#!/usr/bin/env python3
"""One-minute smoke test of an areal-npu image on an Ascend node (A2 or A3).

Two checks, each printed as PASS / FAIL with its numbers:

1. packed attention: ``areal_npu.kernels.packed_attention`` on the NPU (``npu_fusion_attention``,
   layout TND) over a packed batch with GQA, against an independent per-segment float32 reference;
   also checks that changing one segment leaves every other segment's output unchanged.
2. speculative decoding: a tiny Qwen3.5-architecture model with an MTP head (built locally, no
   download) served by vLLM / vLLM-Ascend with MTP drafting; greedy generation must produce
   tokens and the engine must report speculative drafts.

On a machine without an NPU it exits with status 3 and says so; nothing is reported as passed.

    python3 scripts/npu_smoke.py                  # both checks (in the image: /opt/areal-npu/scripts)
    python3 scripts/npu_smoke.py --skip-vllm      # attention only (seconds)
    python3 scripts/npu_smoke.py --device cpu --skip-vllm   # the script's own check, on the CPU path
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

EXIT_OK, EXIT_FAIL, EXIT_NO_NPU = 0, 1, 3

# The packing example from the docs (27, 7, 13, 4) plus a longer segment; heads as a GQA model.
SEGMENT_LENGTHS = (27, 7, 13, 4, 300)
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 128


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Exit status: 0 all checks passed, 1 a check failed, 3 no Ascend NPU on this machine.",
    )
    parser.add_argument("--skip-attention", action="store_true", help="skip the packed attention check")
    parser.add_argument("--skip-vllm", action="store_true", help="skip the vLLM speculative decoding check")
    parser.add_argument("--spec-method", default="mtp",
                        help="vLLM speculative method (default: mtp; vLLM-Ascend also accepts qwen3_5_mtp)")
    parser.add_argument("--num-spec-tokens", type=int, default=3, help="draft tokens per step (default: 3)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt (default: 64)")
    parser.add_argument("--device", choices=("npu", "cpu"), default="npu",
                        help="cpu runs the attention check on the CPU path: a test of this script, "
                             "not of an NPU (default: npu)")
    return parser.parse_args(argv)


def npu_status() -> tuple[bool, str]:
    """(available, reason), without letting torch_npu's autoload break ``import torch``."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        from areal_npu.platform import current_platform
    except ImportError as exc:
        return False, f"areal_npu is not importable ({exc})"
    plat = current_platform()
    if plat.device_type == "npu":
        return True, plat.reason
    return False, plat.warning or plat.reason


def call_packed_attention(q, k, v, cu_seqlens, max_seqlen):
    """The one call into the project's kernel; adapt here if its entry point changes."""
    from areal_npu.kernels.packed_attention import packed_attention

    return packed_attention(q, k, v, cu_seqlens, max_seqlen)


def reference_attention(q, k, v, lengths):
    """Causal softmax attention per segment in float32, written out independently of the kernel."""
    import torch

    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs = q[start:start + n].float().transpose(0, 1)                     # [Hq, n, d]
        ks = k[start:start + n].float().repeat_interleave(group, 1).transpose(0, 1)
        vs = v[start:start + n].float().repeat_interleave(group, 1).transpose(0, 1)
        scores = qs @ ks.transpose(1, 2) / math.sqrt(q.shape[-1])            # [Hq, n, n]
        future = torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), diagonal=1)
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        outs.append((probs @ vs).transpose(0, 1))                          # [n, Hq, d]
        start += n
    return torch.cat(outs)


def check_packed_attention(device: str) -> tuple[bool, str]:
    import torch

    if device == "npu":
        from areal_npu.platform import import_torch_npu

        import_torch_npu()
    dtype = torch.bfloat16 if device == "npu" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    gen = torch.Generator().manual_seed(0)
    total = sum(SEGMENT_LENGTHS)

    def rand(heads):
        return torch.randn(total, heads, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)

    q, k, v = rand(NUM_Q_HEADS), rand(NUM_KV_HEADS), rand(NUM_KV_HEADS)
    offsets = [0]
    for n in SEGMENT_LENGTHS:
        offsets.append(offsets[-1] + n)
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
    max_seqlen = max(SEGMENT_LENGTHS)

    out = call_packed_attention(q, k, v, cu_seqlens, max_seqlen)
    err = (out.float() - reference_attention(q, k, v, SEGMENT_LENGTHS)).abs().max().item()

    # Isolation: new keys/values in segment 1 must not move any other segment's output.
    k2, v2 = k.clone(), v.clone()
    s, e = offsets[1], offsets[2]
    k2[s:e], v2[s:e] = rand(NUM_KV_HEADS)[s:e], rand(NUM_KV_HEADS)[s:e]
    out2 = call_packed_attention(q, k2, v2, cu_seqlens, max_seqlen)
    others = torch.ones(total, dtype=torch.bool, device=device)
    others[s:e] = False
    leak = (out2[others].float() - out[others].float()).abs().max().item()

    ok = err <= tol and leak <= tol
    return ok, (f"segments {list(SEGMENT_LENGTHS)}, heads {NUM_Q_HEADS}/{NUM_KV_HEADS}, dim {HEAD_DIM}, "
                f"{str(dtype).removeprefix('torch.')}: max |out - reference| = {err:.2e}, "
                f"cross-segment change = {leak:.2e} (tolerance {tol:.0e})")


def spec_decode_counts(llm) -> dict[str, float]:
    counts: dict[str, float] = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - metrics are reported, not required, by older engines
        return counts
    for metric in metrics:
        if metric.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"):
            counts[metric.name.rsplit(":", 1)[-1]] = float(getattr(metric, "value", 0) or 0)
    return counts


def check_vllm_speculative(args: argparse.Namespace) -> tuple[bool, str]:
    from vllm import LLM, SamplingParams

    from areal_npu.model.tiny import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="areal-npu-smoke-") as model_dir:
        save_tiny_model(model_dir)
        llm = LLM(
            model=model_dir,
            speculative_config={"method": args.spec_method, "num_speculative_tokens": args.num_spec_tokens},
            # the default tiny model is the published (VL) layout, as vLLM(-Ascend) 0.23 requires; text only
            limit_mm_per_prompt={"image": 0, "video": 0},
            enforce_eager=True,
            max_model_len=1024,
            gpu_memory_utilization=0.3,
            disable_log_stats=False,
            seed=0,
        )
        prompts = ["def add(a, b):", "The quick brown fox", "1, 2, 3, 4,", "hello"]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        counts = spec_decode_counts(llm)
    generated = [len(o.outputs[0].token_ids) for o in outputs]
    drafts = counts.get("spec_decode_num_drafts", 0.0)
    accepted = counts.get("spec_decode_num_accepted_tokens", 0.0)
    ok = all(n == args.max_tokens for n in generated) and drafts > 0
    mean_len = 1 + accepted / drafts if drafts else float("nan")
    return ok, (f"method {args.spec_method}, k={args.num_spec_tokens}: generated {generated} tokens in "
                f"{seconds:.1f} s; drafts {drafts:.0f}, accepted {accepted:.0f}, mean accepted length "
                f"{mean_len:.2f} (a random tiny model accepts little; drafts > 0 is what is checked)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "npu":
        available, reason = npu_status()
        if not available:
            print(f"npu_smoke: no usable Ascend NPU on this machine ({reason}). This smoke test runs on "
                  "an A2/A3 node inside the areal-npu image (see docker/README.md); nothing was tested.",
                  file=sys.stderr)
            return EXIT_NO_NPU
    checks = []
    if not args.skip_attention:
        checks.append(("packed attention", lambda: check_packed_attention(args.device)))
    if not args.skip_vllm:
        if args.device != "npu":
            print("npu_smoke: the vLLM check runs on an NPU only; skipped with --device cpu", file=sys.stderr)
        else:
            checks.append(("vLLM speculative decoding", lambda: check_vllm_speculative(args)))
    failed = 0
    for name, run in checks:
        try:
            ok, detail = run()
        except Exception as exc:  # noqa: BLE001 - a smoke test reports every failure and goes on
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)
    print(f"npu_smoke: {len(checks) - failed}/{len(checks)} checks passed")
    return EXIT_FAIL if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
