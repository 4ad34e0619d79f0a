"""Without a control group a jail's process count is RLIMIT_NPROC in its own user namespace: a fork
bomb fails past ``max_processes`` while ten other processes of the same host user run beside it
(they do not count). The kernel never checks RLIMIT_NPROC for root, so as root the attack runs as
an unprivileged user (``nobody``) through the public jail API; checked from outside (the forks the
program managed), not by what the jail reports."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import areal_npu
from areal_npu.agent.jail import backend

JAIL_OK, JAIL_WHY = backend("bwrap").available()
pytestmark = pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")
PROJECT = str(Path(areal_npu.__file__).resolve().parents[1])
NOBODY = 65534
LIMIT = 8
HOST_PROCESSES = 10  # the user's own processes outside the jail: more than LIMIT

# forks 3 x LIMIT sleepers inside the jail; prints how many forks succeeded and failed
FORKS = textwrap.dedent(f"""
    import os, time
    made = failed = 0
    for _ in range({3 * LIMIT}):
        try:
            pid = os.fork()
        except OSError:
            failed += 1
            continue
        if pid == 0:
            time.sleep(3)
            os._exit(0)
        made += 1
    print(made, failed)
""")
# run by the trainer's user: no control group, HOST_PROCESSES sleepers beside, one jailed fork bomb
ATTACK = textwrap.dedent(f"""
    import json, subprocess, sys
    from areal_npu.agent import jail
    jail.open_group = lambda limits: (None, "none (test)")
    beside = [subprocess.Popen(["sleep", "30"]) for _ in range({HOST_PROCESSES})]
    try:
        res = jail.BubblewrapJail().run([jail.interpreter(), "-c", sys.argv[1]], [],
                                        jail.JailLimits(wall_seconds=30, max_processes={LIMIT}))
    finally:
        for p in beside:
            p.kill()
    print(json.dumps({{"output": res.output.decode(), "layers": res.layers, "error": res.error}}))
""")


def _run_attack() -> dict:
    own_tmp = None  # the temporary directory made for nobody, removed after the run
    if os.geteuid() != 0:
        cmd, kwargs = [sys.executable, "-c", ATTACK, FORKS], {"env": {**os.environ, "PYTHONPATH": PROJECT}}
    else:  # as nobody, on an interpreter and a temporary directory that user can reach
        python = f"/usr/bin/python{sys.version_info[0]}.{sys.version_info[1]}"
        scratch = next((d for d in ("/var/tmp", "/dev/shm") if os.path.isdir(d) and os.stat(d).st_mode & 0o777 == 0o777),
                       None)  # fmt: skip
        if not os.access(python, os.X_OK) or scratch is None:
            pytest.skip(
                f"as root the attack runs as nobody, which needs {python} and a world-writable temp dir"
            )
        site = next(p for p in sys.path if p.endswith("site-packages"))
        env = {
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": f"{PROJECT}:{site}",
            "TMPDIR": (own_tmp := tempfile.mkdtemp(dir=scratch)),
        }
        os.chmod(own_tmp, 0o777)
        cmd = [python, "-c", ATTACK, FORKS]
        kwargs = {"env": env, "user": NOBODY, "group": NOBODY, "extra_groups": [], "cwd": env["TMPDIR"]}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    finally:
        if own_tmp is not None:
            shutil.rmtree(own_tmp, ignore_errors=True)
    if done.returncode != 0:
        pytest.skip(f"the unprivileged attack could not start here: {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fork_bomb_fails_past_max_processes_without_a_cgroup():
    # before: max_processes was not enforced without a delegated cgroup (305 processes against 64)
    result = _run_attack()
    assert result["error"] == "", result
    made, failed = (int(x) for x in result["output"].split())
    # the jail's own init and the program count too; the user's other processes do not (they
    # outnumber the limit: had they counted, no fork would have succeeded)
    assert 1 <= LIMIT - 3 <= made < LIMIT and failed == 3 * LIMIT - made, result
    assert "nproc_rlimit" in result["layers"], result
