"""Megatron is imported through the device seam: MindSpeed's adaptor first on the NPU, never elsewhere.

Recording fakes stand in for ``mindspeed`` (NPU-only) in a fresh interpreter, so the import order
is observed from a clean ``sys.modules``.
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron

_PROBE = textwrap.dedent(
    """
    import importlib.abc, importlib.machinery, json, sys, types

    events = []

    class Recorder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        # fakes mindspeed (absent here) and records when megatron.core and the adaptor are imported
        def find_spec(self, name, path=None, target=None):
            if name in ("megatron.core",):
                events.append(name)
            if name == "mindspeed" or name.startswith("mindspeed."):
                return importlib.machinery.ModuleSpec(name, self, is_package=name == "mindspeed")
            return None

        def create_module(self, spec):
            return types.ModuleType(spec.name)

        def exec_module(self, module):
            events.append(module.__name__)
            module.megatron_loaded = "megatron.core" in sys.modules

    sys.meta_path.insert(0, Recorder())
    from areal_npu.platform import PROFILES, Platform
    from areal_npu.train.megatron import runtime

    {body}
    print(json.dumps(events))
    """
)


def _run(body: str) -> list[str]:
    code = _PROBE.format(body=textwrap.indent(textwrap.dedent(body), "").strip())
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_npu_imports_the_mindspeed_adaptor_before_megatron():
    events = _run(
        """
        runtime.import_megatron(Platform(PROFILES["npu"], reason="test"))
        assert sys.modules["mindspeed.megatron_adaptor"].megatron_loaded is False
        """
    )
    assert events.index("mindspeed.megatron_adaptor") < events.index("megatron.core")


def test_cpu_never_imports_mindspeed_and_importing_the_package_imports_no_megatron():
    events = _run(
        """
        import areal_npu.train.megatron.engine, areal_npu.train.megatron.convert
        assert "megatron" not in sys.modules, "importing the engine module must not import megatron"
        runtime.import_megatron(Platform(PROFILES["cpu"], reason="test"))
        """
    )
    assert events == ["megatron.core"]


def test_npu_refuses_megatron_imported_too_early():
    events = _run(
        """
        import megatron.core
        try:
            runtime.import_megatron(Platform(PROFILES["npu"], reason="test"))
        except RuntimeError as exc:
            assert "before mindspeed.megatron_adaptor" in str(exc)
        else:
            raise AssertionError("not refused")
        """
    )
    assert not any(e.startswith("mindspeed") for e in events)


def test_an_engine_after_a_new_default_group_equals_one_before():
    """A run ends (``shutdown_distributed``) and another starts in the same process (in-process
    ``areal-npu train`` calls, tests): Megatron's cached groups belonged to the destroyed default
    group ("Group ... is not registered" in CI). The second engine's PPO step equals the first's,
    and its data-parallel group is one of the new default group's."""
    import torch
    import torch.distributed as dist

    from areal_npu.train.dist import init_distributed, shutdown_distributed
    from areal_npu.train.megatron.engine import MegatronEngine
    from tests.support.megatron_tiny import make_samples, megatron_config, ppo_step_outputs, tiny_qwen3

    def step():
        return ppo_step_outputs(
            MegatronEngine.from_hf_model(tiny_qwen3()[1], megatron_config()), make_samples(4)
        )

    init_distributed()
    before = step()
    shutdown_distributed()
    init_distributed()
    after = step()
    from megatron.core import parallel_state as ps

    assert dist.get_rank(ps.get_data_parallel_group()) == 0  # raised for a stale group
    assert before.keys() == after.keys()
    for key in before:
        torch.testing.assert_close(after[key], before[key], rtol=0, atol=0, msg=key)
