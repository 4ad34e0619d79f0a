"""The attacks of issue 16, each through the public grading / environment API, each checked from
OUTSIDE the jail (host files, host processes, the verdict) rather than by what the jail reports."""

import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

import areal_npu
from areal_npu.agent.environments import CommandTests, EnvLimits, RepoEnv, RepoTask
from areal_npu.agent.jail import JailLimits, backend
from areal_npu.agent.sandbox import SandboxLimits, run_tests

JAIL_OK, JAIL_WHY = backend("bwrap").available()
pytestmark = pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")
NO_AUDIT = SandboxLimits(cpu_seconds=2, wall_seconds=20, memory_bytes=256 << 20, output_bytes=8192,
                         audit_hook=False, jail="bwrap")  # fmt: skip
PROJECT_ROOT = Path(areal_npu.__file__).resolve().parents[1]


def _cgroup_layer() -> str | None:
    if not JAIL_OK:
        return None
    layers = run_tests("def f(x):\n    return x\n", [(1, 1)], NO_AUDIT).layers
    return next((x for x in layers if x.startswith("cgroup_")), None)


CGROUP = _cgroup_layer()
needs_cgroup = pytest.mark.skipif(
    CGROUP is None, reason="no delegated cgroup here: limits are per process (rlimits) only"
)


def _program(body: str) -> str:
    return "def f(x):\n" + textwrap.indent(textwrap.dedent(body), "    ")


def _host_processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) and marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _task(files=None, hidden: CommandTests | None = None) -> RepoTask:
    files = files or {"app.py": "def answer():\n    return 41\n"}
    hidden = hidden or CommandTests(command="python3 -c 'import app; assert app.answer() == 42'")
    return RepoTask("attack", "make answer() return 42", files, hidden)


# -- forged or malformed result frames: never an exception, always protocol_error ------------------

_STEAL_NONCE = """
import sys, os
main = sys._getframe(1)
prefix, fd = main.f_locals["prefix"], main.f_locals["result_fd"]
os.write(fd, prefix + BODY + b"\\n")
os._exit(0)
"""
FORGED = {
    "deep_nesting": b"[" * 200_000,
    "deep_value": b'{"results":[{"ok":' + b"[" * 5000 + b"]" * 5000 + b'}],"reason":""}',
    "results_not_a_list": b'{"results":5,"reason":""}',
    "two_keys": b'{"results":[{"ok":3,"err":"x"}],"reason":""}',
    "err_not_a_string": b'{"results":[{"err":5}],"reason":""}',
    "unknown_reason": b'{"results":[],"reason":"ok"}',
    "bare_nan": b'{"results":[{"ok":NaN}],"reason":""}',
    "object_value": b'{"results":[{"ok":{"float":"nan","x":1}}],"reason":""}',
    "layers_not_strings": b'{"results":[{"ok":3}],"reason":"","layers":[{"a":1}]}',
    "extra_key": b'{"results":[{"ok":3}],"reason":"","passed":1}',
    "not_json": b"\xff\xfe garbage",
}


@pytest.mark.parametrize("name", sorted(FORGED))
def test_forged_frames_are_protocol_errors(name):
    body = _STEAL_NONCE.replace("BODY", repr(FORGED[name]))
    res = run_tests(_program(body), [(1, 3)], NO_AUDIT)
    assert (res.passed, res.reason) == (0, "protocol_error")


# -- grading bugs ----------------------------------------------------------------------------------


def test_a_correct_program_that_prints_memoryerror_passes():
    body = """
    import sys
    print("MemoryError")
    print("MemoryError: out of memory", file=sys.stderr)
    return 2 * x + 1
    """
    res = run_tests(_program(body), [(1, 3), (2, 5)], NO_AUDIT)
    assert (res.passed, res.reason) == (2, "ok")


@pytest.mark.parametrize(
    "answer, expected, passes",
    [
        ("float('inf')", float("inf"), True),
        ("float('-inf')", float("-inf"), True),
        ("float('nan')", float("nan"), True),
        ("'inf'", float("inf"), False),  # the string is not the float
        ("float('inf')", "inf", False),
        ("float('nan')", "nan", False),
        ("float('-inf')", float("inf"), False),
    ],
)
def test_non_finite_floats_are_not_strings(answer, expected, passes):
    res = run_tests(_program(f"return {answer}"), [(0, expected)], NO_AUDIT)
    assert res.passed == int(passes)


# -- nothing written outside the episode survives --------------------------------------------------


def test_program_writes_outside_do_not_reach_the_host(tmp_path):
    tag = secrets.token_hex(6)
    victims = [Path("/tmp") / f"areal-{tag}-{i}" for i in range(6)] + [tmp_path / f"areal-{tag}"]
    body = f"""
    import os, ctypes
    tag = {tag!r}
    def attempt(fn):
        try:
            fn()
        except OSError:
            pass
    root = os.open("/", os.O_RDONLY)
    attempt(lambda: os.close(os.open(f"tmp/areal-{{tag}}-0", os.O_CREAT | os.O_WRONLY, dir_fd=root)))
    attempt(lambda: os.mkfifo(f"/tmp/areal-{{tag}}-1"))
    attempt(lambda: os.symlink(f"/tmp/areal-{{tag}}-2", "link") or open("link", "w").write("x"))
    ctypes.CDLL(None).chdir(b"/")  # an FFI chdir the audit hook would never see
    attempt(lambda: open(f"tmp/areal-{{tag}}-3", "w").write("x"))
    attempt(lambda: open(f"usr/areal-{{tag}}-4", "w").write("x"))
    attempt(lambda: open(f"/grader/areal-{{tag}}-5", "w").write("x"))
    attempt(lambda: open({str(victims[-1])!r}, "w").write("x"))
    return 1
    """
    res = run_tests(_program(body), [(0, 1)], NO_AUDIT)
    assert res.reason == "ok", res.stderr_tail
    assert [v for v in victims if os.path.lexists(v)] == []
    assert not list(Path("/usr").glob(f"areal-{tag}*"))


def test_agent_writes_outside_the_repo_do_not_survive_and_the_copy_goes_with_close():
    tag = secrets.token_hex(6)
    env = RepoEnv(_task())
    env.reset()
    host_copy = env.repo
    out, code = env.run(
        f"echo x > /tmp/areal-{tag}; mkfifo /tmp/areal-{tag}-fifo; ln -s /tmp/areal-{tag}-l l; echo x > l; "
        f"cd / && echo x > tmp/areal-{tag}-rel; echo x > usr/areal-{tag}; echo x > /areal-{tag}; "
        "cd /repo && echo kept > inside.txt; exit 0"
    )
    assert code == 0, out
    assert not list(Path("/tmp").glob(f"areal-{tag}*")) and not list(Path("/usr").glob(f"areal-{tag}*"))
    assert not os.path.lexists(f"/areal-{tag}")
    assert (host_copy / "inside.txt").read_text() == "kept\n"  # the repository copy is the writable place
    assert env.run("cat inside.txt") == ("kept\n", 0)  # and files persist between commands
    env.close()
    assert not host_copy.exists()


# -- hidden tests, other runs, the project: unreadable ---------------------------------------------


def test_the_project_and_its_task_generator_are_out_of_reach():
    # the home folder may hold the interpreter (a pyenv), which the jail mounts; nothing else of it
    home = [str(p) for p in Path.home().iterdir() if not os.path.realpath(sys.base_prefix).startswith(str(p))]
    paths = [str(PROJECT_ROOT), sys.prefix, "/work", str(Path(__file__).parent), *home[:5]]
    body = f"""
    import sys, subprocess
    sys.path[:0] = {[str(PROJECT_ROOT), *sys.path]!r}
    try:
        import areal_npu.agent.tasks  # to rebuild the hidden tests from the seed
        imported = True
    except ImportError:
        imported = False
    import os
    seen = [os.path.exists(p) for p in {paths!r}]
    # the system interpreter starts, but inside the same jail
    probe = subprocess.run(["/usr/bin/env", "python3", "-c", "import areal_npu"], capture_output=True)
    return [imported, probe.returncode == 0] + seen
    """
    res = run_tests(_program(body), [(0, [False] * (2 + len(paths)))], NO_AUDIT)
    assert res.reason == "ok", res.stderr_tail


def test_hidden_tests_exist_only_for_grading():
    marker = f"HIDDEN-{secrets.token_hex(8)}"
    test = (
        "import unittest\nimport app\n\n\nclass T(unittest.TestCase):\n    def test_answer(self):\n"
        "        self.assertEqual(app.answer(), 42)\n"
    )
    uid = "test_answer (tests_hidden.T" + (".test_answer)" if sys.version_info >= (3, 11) else ")")
    hidden = CommandTests(command="python3 -m unittest -v tests_hidden", fail_to_pass=(uid,), log_parser="django",
                          files={"tests_hidden.py": f"# {marker}\n{test}"})  # fmt: skip
    with RepoEnv(_task(hidden=hidden)) as env:
        # Every file the episode can see, except the read-only host trees (the system and the
        # interpreter: reading all of them took past the command's 30 s on a cold CI disk).
        # The marker is split in the command line, so grep's own /proc entry does not hold it.
        skip = " ".join(f"--exclude-dir={d}" for d in ("proc", "sys", "usr", Path(sys.base_prefix).resolve().name))
        out, _ = env.run(f'M=HIDDEN-; grep -rls --devices=skip {skip} "${{M}}{marker[7:]}" /; echo done')
        assert out.strip() == "done", out
        assert env.grade().reward == 0.0
        assert env.run("ls")[0].split() == ["app.py"]  # grading used its own copy
        env.run("sed -i 's/41/42/' app.py")
        assert env.grade().reward == 1.0


def test_two_episodes_cannot_see_each_other():
    secret = secrets.token_hex(8)
    with RepoEnv(_task()) as a, RepoEnv(_task()) as b:
        a.run(f"echo {secret} > secret.txt")
        out, _ = b.run(
            f'S={secret[:4]}; cat {a.repo}/secret.txt; grep -rls "${{S}}{secret[4:]}" /tmp /repo; echo end'
        )
        assert secret not in out and out.endswith("end\n")


def test_other_processes_command_lines_are_invisible():
    body = """
    import os
    lines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                lines.append(open(f"/proc/{pid}/cmdline", "rb").read())
            except OSError:
                pass
    return any(b"pytest" in line for line in lines) or len(lines) > 8
    """
    assert run_tests(_program(body), [(0, False)], NO_AUDIT).reason == "ok"
    with RepoEnv(_task()) as env:
        out, _ = env.run("cat /proc/*/cmdline | tr '\\0' ' '; echo")
        assert "pytest" not in out


# -- no process outlives the episode ---------------------------------------------------------------


def test_orphans_and_double_forks_die_with_the_program():
    marker = f"{secrets.randbelow(10**6) + 10**6}.25"  # a unique sleep length to find them by
    body = f"""
    import os
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", "{marker}"])
        os._exit(0)
    return 1
    """
    res = run_tests(_program(body), [(0, 1)], NO_AUDIT)
    assert res.reason in ("ok", "protocol_error")  # the forked copy may have written a frame too
    assert _host_processes_with(f"sleep {marker}") == []


def test_background_commands_die_with_the_command():
    marker = f"{secrets.randbelow(10**6) + 10**6}.5"
    with RepoEnv(_task()) as env:
        out, code = env.run(
            f"(setsid sleep {marker} &) ; nohup sleep {marker} >/dev/null 2>&1 & echo started"
        )
        assert (out, code) == ("started\n", 0)
        assert _host_processes_with(f"sleep {marker}") == []


# -- limits hold for the whole process tree --------------------------------------------------------

_FOUR = "for i in 1 2 3 4; do {cmd} & done; wait"


@needs_cgroup
def test_four_processes_share_one_cpu_budget():
    limits = EnvLimits(command=JailLimits(wall_seconds=300, cpu_seconds=2))
    with RepoEnv(_task(), limits) as env:
        out, code = env.run(_FOUR.format(cmd="python3 -c 'while True: pass'"))
    assert code == 124 and "used its 2 CPU seconds" in out  # the budget, not the 300 s wall clock


@needs_cgroup
def test_four_processes_share_one_memory_limit():
    limits = EnvLimits(command=JailLimits(wall_seconds=120, memory_bytes=256 << 20))
    hold = 'python3 -c \'import time; b = b"x" * (150 << 20); time.sleep(20)\'; echo "status $?"'
    with RepoEnv(_task(), limits) as env:
        out, _ = env.run(_FOUR.format(cmd=f"({hold})"))
    # 4 x 150 MiB under one 256 MiB limit: at most one can hold its block at a time
    assert out.count("status 0") <= 1 and out.count("status 137") >= 2, out


@needs_cgroup
def test_fork_bomb_is_capped_and_leaves_nothing():
    limits = EnvLimits(command=JailLimits(wall_seconds=5, max_processes=32))
    marker = f"bomb{secrets.token_hex(4)}"
    with RepoEnv(_task(), limits) as env:
        env.run(f"{marker}() {{ {marker} | {marker} & }}; {marker}")  # its exit code: 0, 124, or 2 when sh cannot fork
        assert _host_processes_with(marker) == []
        assert env.run("echo alive") == ("alive\n", 0)  # the environment outlived the bomb


def test_wall_clock_limit_holds():
    with RepoEnv(_task(), EnvLimits(command=JailLimits(wall_seconds=2))) as env:
        out, code = env.run("sleep 600")
    assert code == 124 and "ran past 2 s" in out


# -- two graders side by side ----------------------------------------------------------------------

_GRADER = """
import json
from areal_npu.agent.reward import reward_many
from areal_npu.agent.tasks import make_dataset
tasks = make_dataset(16, 5, "easy")
print(json.dumps(reward_many(tasks, [t.answer for t in tasks], 4)))
"""


def test_two_grader_processes_do_not_disturb_each_other():
    procs = [subprocess.Popen([sys.executable, "-c", _GRADER], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]  # fmt: skip
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for out in outs:
        assert json.loads(out.strip().splitlines()[-1]) == [[1.0, "ok"]] * 16


# -- sockets, network, kernel interfaces -----------------------------------------------------------


def test_unix_sockets_and_the_network_are_unreachable(tmp_path):
    path = f"/tmp/areal-{secrets.token_hex(6)}.sock"
    abstract = f"\0areal-{secrets.token_hex(6)}"
    servers = []
    for address in (path, abstract):
        s = socket.socket(socket.AF_UNIX)
        s.bind(address)
        s.listen(4)
        servers.append(s)
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    servers.append(tcp)
    body = f"""
    import socket
    reached = []
    for family, address in ((socket.AF_UNIX, {path!r}), (socket.AF_UNIX, {abstract!r}),
                            (socket.AF_INET, ("127.0.0.1", {tcp.getsockname()[1]}))):
        s = socket.socket(family)
        s.settimeout(2)
        try:
            s.connect(address)
            reached.append(True)
        except OSError:
            reached.append(False)
    return reached
    """
    try:
        res = run_tests(_program(body), [(0, [False, False, False])], NO_AUDIT)
        for s in servers:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.accept()  # nobody knocked
    finally:
        for s in servers:
            s.close()
        os.unlink(path)
    assert res.reason == "ok", res.stderr_tail


def test_seccomp_denies_namespace_and_debugging_calls():
    body = """
    import ctypes, os
    libc = ctypes.CDLL(None, use_errno=True)
    return [libc.unshare(0x10000000), libc.ptrace(16, os.getppid(), 0, 0),
            libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)]
    """
    res = run_tests(_program(body), [(0, [-1, -1, -1])], NO_AUDIT)
    assert res.reason == "ok", res.stderr_tail
