"""Shared test set-up.

Tests run in pytest's importlib mode with the repository root kept off ``sys.path`` (so ``kernels/``
is importable only as ``areal_npu.kernels``). Spawned worker processes (torch.multiprocessing
``spawn``) unpickle their target by module name, e.g. ``tests.data.test_packing``; to make ``tests``
importable there without exposing the root, a temporary directory holding only a ``tests`` symlink
is appended to ``sys.path`` (children inherit the parent's ``sys.path``).
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
_shim = Path(tempfile.mkdtemp(prefix="areal-npu-tests-"))
(_shim / "tests").symlink_to(_ROOT / "tests", target_is_directory=True)
sys.path.append(str(_shim))
atexit.register(shutil.rmtree, _shim, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """``full`` tests run only with AREAL_FULL=1: long end-to-end runs whose parts other tests cover,
    left out of CI, whose 90 minutes the whole suite no longer fits on 2 cores."""
    if os.environ.get("AREAL_FULL") == "1":
        return
    skip = pytest.mark.skip(reason="full: AREAL_FULL=1 runs it (left out of CI for time)")
    for item in items:
        if item.get_closest_marker("full"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _platform_unchanged():
    """A test that makes another device this process's platform (``platform.use_device`` writes
    ``AREAL_NPU_DEVICE``) must not leave it so: on a GPU machine every later engine test would
    then put its batches on the CPU while FSDP2 keeps the model on the GPU."""
    before = os.environ.get("AREAL_NPU_DEVICE")
    yield
    if os.environ.get("AREAL_NPU_DEVICE") != before:
        if before is None:
            os.environ.pop("AREAL_NPU_DEVICE", None)
        else:
            os.environ["AREAL_NPU_DEVICE"] = before
        from areal_npu.platform import current_platform

        current_platform.cache_clear()
        pytest.fail("the test changed AREAL_NPU_DEVICE and did not restore it", pytrace=False)


def pytest_configure(config):
    """transformers' logging handler writes to the ``sys.stderr`` of the moment it is first used:
    under ``capsys`` that is the test's capture file, closed when the test ends, and every later
    transformers warning then fails to print ("I/O operation on closed file") onto stderr that
    tests read. Creating the handler here binds it to the real stderr, whatever test runs first."""
    from transformers.utils import logging as hf_logging

    hf_logging.get_logger("transformers")
