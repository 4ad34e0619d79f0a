"""The torchrun command that starts a run's trainer ranks on this node.

``areal-npu train`` with several trainer ranks (the layout's world size > 1) becomes torchrun
(``cli.py`` execs this command), which starts one ``areal-npu train`` per rank with torchrun's
variables; each of those then runs the job (``run.run_rl``). On several nodes each node starts
torchrun itself (the recipes' ``_launch.sh``), or the Ray launcher (``ray_launch``) sets the same
variables from the plan.
"""

from __future__ import annotations

import os
import sys

from areal_npu.placement import TrainerLayout
from areal_npu.recipe import RLConfig
from areal_npu.train.factory import check_world_size


def torchrun_command(cfg: RLConfig, argv: list[str]) -> list[str] | None:
    """The command that starts this run's trainer ranks, when it needs several and this process is
    not one of them yet: torchrun on this node, one process per rank of the layout, each running
    ``areal-npu`` with ``argv`` (``train RECIPE ...``). ``None``: run here (one rank, or already
    started by torchrun). Several nodes start torchrun themselves (``--nnodes``, ``--rdzv-endpoint``)."""
    world = TrainerLayout.of(cfg.train).world_size
    if world == 1 or "WORLD_SIZE" in os.environ:
        return None
    check_world_size(cfg.train, world)  # what a multi-rank run cannot do, refused before starting it
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
            "-m", "areal_npu.cli", *argv]  # fmt: skip
