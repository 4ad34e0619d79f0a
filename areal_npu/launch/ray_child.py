"""``python -m areal_npu.launch.ray_child CMD ...``: run CMD and end this whole session when the
Ray actor that started it dies.

The Ray launcher's actors start each trainer rank in a session of its own (so stopping it reaches
every process it started); a SIGKILLed actor (``ray.kill``, a lost node, an OOM kill) would leave
that session running. This wrapper, the session leader, watches its parent
(:func:`~areal_npu.rollout.parent_watch.die_with_parent`) and exits with CMD's exit code.
Standard library only: it starts before anything heavy is imported.
"""

import signal
import subprocess
import sys

from areal_npu.rollout.parent_watch import die_with_parent


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m areal_npu.launch.ray_child CMD [ARG ...]", file=sys.stderr)
        return 2
    die_with_parent()
    child = subprocess.Popen(argv)
    # SIGTERM reaches the whole group (the actor's stop); the child handles it, we wait for its code
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
