"""Shared test set-up.

Tests run in pytest's importlib mode with the repository root kept off ``sys.path`` (so ``kernels/``
is importable only as ``areal_npu.kernels``). Spawned worker processes (torch.multiprocessing
``spawn``) unpickle their target by module name, e.g. ``tests.data.test_packing``; to make ``tests``
importable there without exposing the root, a temporary directory holding only a ``tests`` symlink
is appended to ``sys.path`` (children inherit the parent's ``sys.path``).
"""

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
_shim = Path(tempfile.mkdtemp(prefix="areal-npu-tests-"))
(_shim / "tests").symlink_to(_ROOT / "tests", target_is_directory=True)
sys.path.append(str(_shim))
atexit.register(shutil.rmtree, _shim, ignore_errors=True)
