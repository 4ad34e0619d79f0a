"""areal-npu: NPU-first asynchronous RL post-training for LLM agents.

Kept import-light: it runs at every interpreter start of the project's environment (the compat
start-up hook lives in this package), so nothing heavy is imported here.
"""

import importlib.util as _importlib_util
import os as _os
import sys as _sys

__version__ = "0.1.0"

# torch_npu registers itself through torch's device-backend autoload; on a machine where torch_npu
# is installed but CANN is missing, that autoload breaks `import torch` itself. We import torch_npu
# explicitly in platform.py instead, so autoload is switched off before anyone imports torch.
if "torch" not in _sys.modules and _importlib_util.find_spec("torch_npu") is not None:
    _os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
