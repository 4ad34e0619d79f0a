"""Sandbox containment and grading. Limits are small and wall timeouts generous; no timing asserts."""

import os
import socket
import threading
import time

import psutil
import pytest

from areal_npu.agent import sandbox
from areal_npu.agent.jail import backend
from areal_npu.agent.reward import reward, reward_many, reward_stats
from areal_npu.agent.sandbox import REASONS, SandboxLimits, grade_many, run_tests
from areal_npu.agent.tasks import LEVELS, make_dataset, to_program

ROOT = os.geteuid() == 0
JAIL_OK, JAIL_WHY = backend("bwrap").available()
CGROUP = JAIL_OK and any(
    x.startswith("cgroup_") for x in run_tests("def f(x):\n    return x\n", [(1, 1)]).layers
)
LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=10, memory_bytes=256 << 20, output_bytes=8192)
NO_AUDIT = SandboxLimits(**{**LIMITS.__dict__, "audit_hook": False})
TESTS = [(1, 3), (2, 5), (3, 7)]  # f(x) = 2*x+1


def _live(procs):
    out = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _sandbox_uid_processes():
    lo = LIMITS.uid_base
    procs = []
    for p in psutil.process_iter():
        try:
            if lo <= p.uids().real < lo + 1024:
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    return _live(procs)


@pytest.fixture(autouse=True)
def no_strays():
    yield
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        strays = _live(psutil.Process().children(recursive=True)) + _sandbox_uid_processes()
        if not strays:
            return
        time.sleep(0.1)
    pytest.fail(f"stray processes after the test: {strays}")


def _run(body: str, limits=LIMITS, tests=TESTS):
    return run_tests(f"def f(x):\n{body}\n", tests, limits)


def test_correct_and_wrong_programs():
    ok = _run("    return 2*x+1")
    assert (ok.passed, ok.total, ok.reason) == (3, 3, "ok") and ok.fraction == 1.0
    half = _run("    return 3 if x == 1 else 0")
    assert (half.passed, half.reason) == (1, "wrong_answer")
    assert _run("    return x*2").reason == "wrong_answer"
    assert _run("    return [1][x]").reason == "crash"
    assert run_tests("def f(x) return", TESTS, LIMITS).reason == "syntax_error"
    assert run_tests("   ", TESTS, LIMITS).reason == "no_program"
    assert run_tests("g = 1", TESTS, LIMITS).reason == "crash"


def test_exact_types_are_compared():
    assert _run("    return float(2*x+1)").reason == "wrong_answer"
    assert run_tests("def f(x):\n    return x > 0", [(1, 1)], LIMITS).reason == "wrong_answer"
    assert run_tests("def f(x):\n    return (x, x)", [(1, [1, 1])], LIMITS).reason == "ok"


def test_layers_reported():
    layers = _run("    return 2*x+1").layers
    assert {"clean_env", "rlimits", "audit_hook"} <= set(layers)
    if JAIL_OK:
        assert {"bwrap", "userns", "pidns", "netns", "mountns", "no_new_privs", "caps_dropped"} <= set(layers)
    else:
        assert "process_sandbox" in layers


@pytest.mark.parametrize("limits", [LIMITS, NO_AUDIT], ids=["audit", "kernel_only"])
def test_infinite_loop_is_a_timeout(limits):
    assert _run("    while True: pass", limits).reason == "timeout"


def test_sleeping_program_hits_the_wall_clock():
    res = _run(
        "    import time\n    time.sleep(600)", SandboxLimits(**{**LIMITS.__dict__, "wall_seconds": 2})
    )
    assert (res.passed, res.reason) == (0, "timeout")


@pytest.mark.parametrize("limits", [LIMITS, NO_AUDIT], ids=["audit", "kernel_only"])
def test_memory_hog(limits):
    res = _run("    return len(bytearray(10**9))", limits)
    assert (res.passed, res.reason) == (0, "memory")


def test_huge_output():
    res = _run("    print('y' * 10**6)\n    return 2*x+1")
    assert (res.passed, res.reason) == (0, "output_limit")
    res = _run("    return 'y' * 10**6", tests=[(1, "y")])
    assert (res.passed, res.reason) == (0, "output_limit")


def test_fork_bomb_audit_layer():
    res = _run("    import os\n    while True: os.fork()")
    assert (res.passed, res.reason) == (0, "blocked_syscall")


@pytest.mark.skipif(
    not (JAIL_OK and CGROUP) and not ROOT,
    reason="the process count is capped by the jail's pids cgroup, or RLIMIT_NPROC of a dropped uid",
)
def test_fork_bomb_kernel_layers():
    body = "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n            pass"
    res = _run(body, SandboxLimits(**{**NO_AUDIT.__dict__, "wall_seconds": 3}))
    assert (res.passed, res.reason) == (0, "timeout")  # the fixture checks that nothing survived


@pytest.mark.skipif(
    not JAIL_OK and not ROOT, reason="needs the jail's PID namespace or kills by a dropped uid"
)
def test_escaped_grandchildren_are_killed():
    body = "    import os, time\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(600)\n    return 2*x+1"
    res = _run(body, NO_AUDIT, tests=[(1, 3)])
    assert res.passed <= 1  # the forked copy may also write a frame; no trust is placed in either


def test_network_is_blocked_by_audit_hook():
    res = _run(
        "    import socket\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\n    return 2*x+1"
    )
    assert (res.passed, res.reason) == (0, "blocked_syscall")


def test_network_namespace_has_no_route():
    if "netns" not in _run("    return 2*x+1").layers:
        pytest.skip("no network namespace here")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    limits = SandboxLimits(**{**NO_AUDIT.__dict__, "drop_privileges": False})  # stdlib readable
    body = (
        "    import socket\n    try:\n"
        f"        socket.create_connection(('127.0.0.1', {port}), timeout=2)\n        return 1\n"
        "    except OSError:\n        return 0"
    )
    try:
        res = run_tests(f"def f(x):\n{body}\n", [(0, 1)], limits)
    finally:
        server.close()
    assert (res.passed, res.reason) == (0, "wrong_answer")


def test_writes_outside_the_workdir(tmp_path):
    target = tmp_path / "pwned"
    body = f"    open({str(target)!r}, 'w').write('x')\n    return 2*x+1"
    # the audit hook blocks it, or (in the jail, where /tmp is private) the path does not exist there
    assert _run(body).reason in ("blocked_syscall", "crash")
    assert not target.exists()
    if ROOT or JAIL_OK:
        assert _run(body, NO_AUDIT).reason == "crash"  # not in the jail's view / the dropped uid cannot write
        assert not target.exists()
    inside = "    open('scratch.txt', 'w').write('ok')\n    return 2*x+1"
    assert _run(inside).reason == "ok"


def test_parent_environment_is_invisible(monkeypatch):
    secret = "s3cr3t-areal-token"
    monkeypatch.setenv("AREAL_TEST_SECRET", secret)
    res = _run("    import os\n    return os.environ.get('AREAL_TEST_SECRET', '')", tests=[(0, secret)])
    assert (res.passed, res.reason) == (0, "wrong_answer")
    proc = "    import os\n    return open('/proc/%d/environ' % os.getppid()).read().split('AREAL_TEST_SECRET=')[1][:18]"
    assert _run(proc, tests=[(0, secret)]).reason == "blocked_syscall"
    if ROOT or JAIL_OK:
        res = _run(proc, NO_AUDIT, tests=[(0, secret)])
        assert (res.passed, res.reason) == (0, "crash")


def test_forging_the_result_protocol():
    fake = '{"results":[{"ok":3},{"ok":5},{"ok":7}],"reason":"","layers":[]}'
    printer = f"    print({fake!r})\n    print('passed 3/3')\n    return 0"
    assert _run(printer).reason == "wrong_answer"
    # every descriptor the child may hold: the result file keeps the parent's number (pass_fds), which
    # in a long test session with many open files lies above the first few dozen
    writer = (
        "    import os\n    for fd in range(3, 1 << 16):\n        try:\n"
        f"            os.write(fd, b'0' * 32 + b' ' + {fake.encode()!r} + b'\\n')\n"
        "        except OSError:\n            pass\n    return 0"
    )
    res = _run(writer)
    assert (res.passed, res.reason) == (0, "protocol_error")
    nonce_hunt = "    import sys\n    return str(sys._getframe(2).f_locals)"
    assert _run(nonce_hunt).reason == "blocked_syscall"
    gc_hunt = "    import gc\n    return len(gc.get_objects())"
    assert _run(gc_hunt).reason == "blocked_syscall"
    liar = "    class Eq(int):\n        def __eq__(self, other):\n            return True\n    return Eq(0)"
    assert _run(liar).reason == "crash"  # only exact builtin types leave the child
    exiter = "import os\nos._exit(0)\n"
    assert run_tests(exiter, TESTS, LIMITS).reason == "protocol_error"


def test_grade_many_keeps_order_and_bounds_concurrency(monkeypatch):
    live, peak, lock = [0], [0], threading.Lock()
    real = sandbox.run_tests

    def counting(program, tests, limits=None):
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        try:
            return real(program, tests, limits)
        finally:
            with lock:
                live[0] -= 1

    monkeypatch.setattr(sandbox, "run_tests", counting)
    programs = [to_program(f"{k}*x") for k in range(8)]
    results = grade_many([(p, [(1, k)]) for k, p in enumerate(programs)], max_workers=3, limits=LIMITS)
    assert [r.reason for r in results] == ["ok"] * 8
    assert 1 <= peak[0] <= 3
    assert grade_many([], max_workers=2) == []
    with pytest.raises(ValueError, match="^max_workers"):
        grade_many([("x", [])], max_workers=0)


def test_reference_answers_score_one_and_others_match_the_oracle():
    tasks = [t for level in LEVELS for t in make_dataset(10, 11, level)]
    assert all(r == (1.0, "ok") for r in reward_many(tasks, [t.answer + "\n" for t in tasks], 4, LIMITS))
    # Another task's answer: the sandbox score must equal the fraction an in-process run predicts.
    others = [tasks[(i + 7) % len(tasks)].answer for i in range(len(tasks))]
    got = reward_many(tasks, others, 4, LIMITS)
    for task, answer, (score, reason) in zip(tasks, others, got):
        scope: dict = {}
        exec(to_program(answer), scope)
        hits = 0
        for x, y in task.tests:
            try:
                out = scope["f"](x)
                hits += type(out) is type(y) and out == y
            except Exception:
                pass
        assert score == hits / len(task.tests)
        assert (reason == "ok") == (hits == len(task.tests))
    assert any(score < 1 for score, _ in got)


def test_reward_single_and_stats():
    task = make_dataset(1, 0, "easy")[0]
    assert reward(task, task.answer + "\nrest", LIMITS) == (1.0, "ok")
    assert reward(task, "", LIMITS) == (0.0, "no_program")
    stats = reward_stats(["ok", "ok", "timeout", "weird"])
    assert stats["reward/reason_ok"] == 2 and stats["reward/reason_timeout"] == 1
    assert stats["reward/reason_weird"] == 1 and stats["reward/reason_memory"] == 0
    assert set(f"reward/reason_{r}" for r in REASONS) <= set(stats)


def test_limits_validation():
    for field, value in [
        ("cpu_seconds", 0),
        ("memory_bytes", 1 << 20),
        ("wall_seconds", 0),
        ("uid_base", 0),
        ("jail", "docker"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}"):
            SandboxLimits(**{field: value}).validate()
    SandboxLimits().validate()
