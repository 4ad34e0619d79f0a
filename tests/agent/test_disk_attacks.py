"""Host-disk attacks through the public API (RepoEnv.reset/run/grade/close), and what the jail shows of
the host. Each stays inside its limit and raises nothing in the caller. References are independent of
the code under test: coreutils' ``du`` (blocks, inodes, apparent sizes) on the host, counts printed
from inside the jail, and ``/proc/self/mounts``."""

import os
import subprocess
from pathlib import Path

import pytest

from areal_npu.agent import fs
from areal_npu.agent.environments import EnvLimits, RepoEnv, area_sizes, make_base
from areal_npu.agent.jail import JailLimits, backend
from areal_npu.agent.repo_task import CommandTests, RepoTask
from areal_npu.agent.warm_pool import WarmPool
from tests.support.unittest_task import BUGGY, TEST_PATCH, unittest_id

JAIL_OK, JAIL_WHY = backend("bwrap").available()
AREAS_OK, AREAS_WHY = fs.areas_supported()
pytestmark = [
    pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}"),
    pytest.mark.skipif(not AREAS_OK, reason=f"no size-capped areas here: {AREAS_WHY}"),
]

MIB = 1 << 20
QUOTA, FILES = 16 * MIB, 2000  # what a command may leave in the repository copy
GRADING_QUOTA = 32 * MIB
TASK = RepoTask("app", "answer() is off by one", {"app.py": BUGGY},
                CommandTests("python3 -m unittest -v test_app", patch=TEST_PATCH,
                             fail_to_pass=(unittest_id("test_answer"),), pass_to_pass=(unittest_id("test_name"),),
                             log_parser="django"))  # fmt: skip
LIMITS = EnvLimits(
    command=JailLimits(
        wall_seconds=60, cpu_seconds=60, disk_bytes=QUOTA, file_bytes=4 * MIB, disk_files=FILES
    ),
    grading=JailLimits(
        wall_seconds=60,
        cpu_seconds=60,
        disk_bytes=GRADING_QUOTA,
        file_bytes=4 * MIB,
        disk_files=FILES,
        output_bytes=1 << 20,
    ),  # fmt: skip
)
FULL_NOTE = f"[the repository reached its size limit ({QUOTA >> 20} MiB or {FILES} new files); the command was killed]"


def du(path: Path, *flags: str) -> int:
    out = subprocess.run(["du", "-s", "--block-size=1", *flags, str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def host_files(path: Path) -> int:
    out = subprocess.run(["du", "-s", "--inodes", str(path)], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/self/mounts").read_text().splitlines())


@pytest.fixture
def make_env():
    """A reset RepoEnv, closed after the test whatever happened (an area left mounted is RAM held)."""
    made = []

    def make() -> RepoEnv:
        made.append(RepoEnv(TASK, LIMITS))
        made[-1].reset()
        return made[-1]

    yield make
    for env in made:
        env.close()


def finish(env: RepoEnv) -> None:
    """grade() and close() raise nothing; the copy and its area are gone."""
    root = env.root
    result = env.grade()
    assert result.reward == 0.0
    env.close()
    assert not root.exists() and not mounted(root / "repo")
    return result


def test_paths_deeper_than_path_max_stay_inside_the_quota(make_env):
    # before: the quota's walk missed them (1 GB written against 64 MiB)
    script = (
        "import os\n"
        "for _ in range(1500):\n"  # 1500 * len('dddd/') > PATH_MAX (4096)
        "    os.mkdir('dddd'); os.chdir('dddd')\n"
        "for i in range(64):\n"
        "    open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
    )
    env = make_env()
    out, code = env.run(f"python3 - <<'EOF'\n{script}EOF")
    assert code == 1 and out.endswith(FULL_NOTE)
    assert du(env.repo) <= QUOTA
    finish(env)


def test_hard_links_neither_take_disk_nor_inflate_the_next_commands_allowance(make_env):
    # before: each link counted again, so the next command was allowed that much more (1.86 GB written)
    env = make_env()
    out, code = env.run("head -c 4194304 /dev/urandom > big; i=0; while ln big l$i; do i=$((i+1)); done")
    links = len(os.listdir(env.repo)) - 2  # app.py, big
    assert FILES - 16 <= links <= FILES + 16 and code == 1 and out.endswith(FULL_NOTE)  # an inode each
    assert du(env.repo, "--apparent-size", "--count-links") > 1000 * 4 * MIB  # what a naive reader sees
    out, code = env.run("rm l1 l2 l3; head -c 33554432 /dev/zero > more; echo $?")
    assert du(env.repo) <= QUOTA
    result = finish(env)  # the grader reads no gigabytes: the episode is over its apparent-size bound
    assert result.details["reason"] == "too_large"


def test_each_command_cannot_add_its_own_overshoot(make_env):
    # before: each command overshot by one poll (582 -> 2242 MiB over 4 commands against 128 MiB)
    env = make_env()
    for n in range(4):
        env.run(f"for i in $(seq 100); do head -c 1048576 /dev/zero > c{n}_$i || exit 1; done")
        assert du(env.repo) <= QUOTA
    finish(env)


def test_sparse_files_cost_what_they_hold_and_the_grader_reads_no_more_than_its_bound(make_env):
    # before: the grading copy filled them in (+4 GB of host disk)
    env = make_env()
    assert env.run("truncate -s 4M one && echo ok") == ("ok\n", 0)
    assert du(env.repo) < MIB
    small = env.grade()  # within the grader's bound: graded as usual, the copy within its own area
    assert small.details["reason"] == "unresolved" and small.details["grading_area"] is True
    # git reads files through mmap, and a read fault on a tmpfs hole allocates a page: the area's cap
    # is what bounds that
    assert du(env.repo) <= QUOTA
    env.run("for i in $(seq 200); do truncate -s 4M s$i; done")
    assert du(env.repo) <= QUOTA and du(env.repo, "--apparent-size") > 200 * 4 * MIB > GRADING_QUOTA
    assert finish(env).details["reason"] == "too_large"


def test_many_empty_files_are_capped_by_the_inode_limit(make_env):
    # before: 200k empty files cost nothing against the quota and slowed grading to 16 s
    env = make_env()
    base_files = host_files(env.repo)
    out, code = env.run("python3 -c \"\nfor n in range(200000):\n    open(f'e{n}', 'w').close()\n\"")
    made = len(os.listdir(env.repo)) - 1  # app.py
    assert FILES <= made <= FILES + 16 and code == 1 and out.endswith(FULL_NOTE)
    assert host_files(env.repo) <= base_files + FILES + 16
    assert finish(env).details["reason"] == "unresolved"  # graded: the tests ran on the (bounded) copy


def test_pool_copies_are_areas_and_the_jail_shows_no_host_path():
    """The warm pool's copies are size-capped areas; inside the jail, /proc/self/mountinfo and
    /proc/1/cmdline name neither the episode's host directory nor the trainer's working directory."""
    pool = WarmPool(lambda task, dest: make_base(task, dest, None), area=area_sizes(LIMITS.command))
    try:
        pool.prefetch(TASK, 1)
        with RepoEnv(TASK, LIMITS, pool=pool) as env:
            out, code = env.run("df -B1 --output=size,itotal . | tail -1")
            assert code == 0 and [int(x) for x in out.split()] == [
                QUOTA,
                host_files(env.repo) - 1 + FILES + 16,
            ]
            out, code = env.run("cat /proc/self/mountinfo; tr '\\0' ' ' < /proc/1/cmdline")
            assert code == 0 and "bwrap --args" in out
            for host_path in (str(env.root), os.getcwd()):
                assert host_path not in out
            finish(env)
    finally:
        pool.close()


def test_without_a_cgroup_dev_and_shm_stay_capped_and_the_episode_says_which_limits_held(monkeypatch):
    # before: /dev/shm held RAM with no cap (2.9 GB) where no control group could be made
    from areal_npu.agent import jail

    shm = 8 * MIB
    limits = EnvLimits(command=JailLimits(wall_seconds=30, cpu_seconds=30, tmp_bytes=shm, disk_bytes=QUOTA))
    script = "touch /dev/x && echo DEV; head -c 67108864 /dev/zero > /dev/shm/x; df -B1 --output=used /dev/shm | tail -1"
    with RepoEnv(TASK, limits) as env:
        out, _ = env.run(script)
        assert int(out.split()[-1]) <= shm and "DEV" not in out
        held = env.limits_held()
        monkeypatch.setattr(jail, "open_group", lambda limits: (None, "no delegated cgroup (test)"))
        out, _ = env.run(script)
        assert int(out.split()[-1]) <= shm and "DEV" not in out
        assert env.limits_held() == {"cgroup": 0, "disk_area": 1}  # one command without: the episode says 0
    assert held == {"cgroup": int(_cgroup_here()), "disk_area": 1}


def _cgroup_here() -> bool:
    from areal_npu.agent import cgroups

    return cgroups.probe()[0]


def test_tmp_and_shm_are_capped_in_files_too(make_env):
    # bwrap's own tmpfs takes a byte size only: empty files there would cost kernel memory unbounded
    env = make_env()
    for folder in ("/tmp", "/dev/shm"):
        script = f"import os\nn = 0\ntry:\n    while n < 200000:\n        open(f'{folder}/e{{n}}', 'w').close(); n += 1\n"
        out, code = env.run(f"python3 - <<'EOF'\n{script}except OSError:\n    print(n)\nEOF")
        assert code == 0 and FILES - 16 <= int(out.split()[-1]) < FILES
