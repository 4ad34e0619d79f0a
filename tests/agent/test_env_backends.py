"""Environment backends and the warm pool. Container engines do not run on this machine: their
command lines are checked against what the engines document, and their runs go through a recording
fake of the engine (a script on PATH that logs its argv and runs the command in the mounted folder)."""

from __future__ import annotations

import concurrent.futures
import filecmp
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from areal_npu import cli
from areal_npu.agent import env_backends
from areal_npu.agent.env_backends import ContainerBackend, EnvConfig, ProcessBackend, resolve
from areal_npu.agent.jail import JailLimits
from areal_npu.agent.warm_pool import WarmPool
from areal_npu.config import ConfigError
from areal_npu.platform import current_platform

# A fake engine: logs argv to $FAKE_LOG; `run ... --volume SRC:DST:rw --workdir DST IMAGE /bin/sh -c CMD`
# runs CMD in SRC; `info`/`version`/`rm`/`create` succeed (with $FAKE_DOWN set, `info`/`version` fail as
# an engine without its daemon does); `cp NAME:DIR/. DEST` copies $FAKE_IMAGE/DIR; `image inspect REF`
# succeeds when REF is one of the comma-separated $FAKE_IMAGES (the local image store).
FAKE = r"""#!{python}
import json, os, shutil, subprocess, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as fh:
    fh.write(json.dumps(argv) + "\n")
if argv[0] in ("info", "version") and os.environ.get("FAKE_DOWN"):
    sys.exit("Cannot connect to the engine's daemon. Is it running?")
if argv[:2] == ["image", "inspect"]:
    if argv[2] in os.environ.get("FAKE_IMAGES", "").split(","):
        sys.exit(print(json.dumps([{{"Id": "sha256:0"}}])))
    sys.exit("Error: No such image: " + argv[2])
if argv[0] in ("run", "exec"):
    src = None
    for i, a in enumerate(argv):
        if a in ("--volume", "--bind") and ":" in argv[i + 1]:
            src = argv[i + 1].split(":")[0]
    cmd = argv[argv.index("-c") + 1]
    sys.exit(subprocess.call(["/bin/sh", "-c", cmd], cwd=src))
if argv[0] == "cp":
    image_dir = argv[1].split(":", 1)[1].rstrip(".").rstrip("/")
    shutil.copytree(os.environ["FAKE_IMAGE"] + image_dir, argv[2], dirs_exist_ok=True)
"""


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("docker", "podman", "apptainer"):
        path = bin_dir / tool
        path.write_text(FAKE.format(python=sys.executable))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_IMAGE", str(tmp_path / "image"))

    def calls() -> list[list[str]]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    return bin_dir, calls


def _flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == name]


@pytest.mark.parametrize("tool", ["docker", "podman"])
def test_docker_and_podman_command_lines_carry_every_limit(tool, tmp_path):
    limits = JailLimits(cpu_cores=1.5, memory_bytes=3 << 30, max_processes=77, tmp_bytes=5 << 20,
                        max_open_files=99, file_bytes=7 << 20)  # fmt: skip
    argv = ContainerBackend(tool, f"/usr/bin/{tool}").argv("make test", tmp_path, limits, "swe/img:1", "/testbed",
                                                          {"A": "1"}, "areal-x")  # fmt: skip
    assert argv[:3] == [f"/usr/bin/{tool}", "run", "--rm"]
    assert argv[-4:] == ["swe/img:1", "/bin/sh", "-c", "make test"]
    assert _flag(argv, "--network") == ["none"] and "--read-only" in argv
    assert _flag(argv, "--memory") == [str(3 << 30)] and _flag(argv, "--memory-swap") == [str(3 << 30)]
    assert _flag(argv, "--pids-limit") == ["77"] and _flag(argv, "--cpus") == ["1.5"]
    assert f"nofile={99}" in _flag(argv, "--ulimit") and f"fsize={7 << 20}" in _flag(argv, "--ulimit")
    assert _flag(argv, "--tmpfs") == [f"/tmp:rw,size={5 << 20}"]
    assert _flag(argv, "--volume") == [f"{tmp_path}:/testbed:rw"] and _flag(argv, "--workdir") == ["/testbed"]
    assert _flag(argv, "--cap-drop") == ["ALL"] and _flag(argv, "--env") == ["A=1"]
    assert _flag(argv, "--name") == ["areal-x"]


def test_apptainer_command_line(tmp_path):
    argv = ContainerBackend("apptainer", "/usr/bin/apptainer").argv(
        "pytest", tmp_path, JailLimits(memory_bytes=1 << 30), "img.sif", "/testbed", {}, "unused"
    )
    assert argv[:2] == ["/usr/bin/apptainer", "exec"] and "--containall" in argv and "--cleanenv" in argv
    assert "--net" in argv and _flag(argv, "--network") == ["none"]
    assert _flag(argv, "--bind") == [f"{tmp_path}:/testbed"] and _flag(argv, "--pwd") == ["/testbed"]
    assert argv[-4:] == ["img.sif", "/bin/sh", "-c", "pytest"]


def test_container_run_through_a_recording_engine(fake_engine, tmp_path):
    bin_dir, calls = fake_engine
    repo = tmp_path / "repo"
    repo.mkdir()
    be = ContainerBackend("docker", str(bin_dir / "docker"))
    assert be.available() == (True, "")
    res = be.run("echo out; echo made > new.txt; exit 3", repo, JailLimits(), "img:1", "/testbed", {})
    assert (res.exit_code, res.output) == (3, b"out\n")
    assert (repo / "new.txt").read_text() == "made\n"  # files persist in the repository copy
    run = [c for c in calls() if c[0] == "run"][0]
    assert _flag(run, "--volume") == [f"{repo}:/testbed:rw"]


def test_container_timeout_removes_the_container(fake_engine, tmp_path):
    bin_dir, calls = fake_engine
    repo = tmp_path / "repo"
    repo.mkdir()
    be = ContainerBackend("podman", str(bin_dir / "podman"))
    res = be.run("sleep 30", repo, JailLimits(wall_seconds=0.5), "img:1", "/testbed", {})
    assert res.timed_out and res.exit_code is None
    name = _flag([c for c in calls() if c[0] == "run"][0], "--name")[0]
    assert ["rm", "-f", name] in calls()


def test_container_export_repo_copies_the_images_tree(fake_engine, tmp_path):
    bin_dir, calls = fake_engine
    (tmp_path / "image" / "testbed" / "pkg").mkdir(parents=True)
    (tmp_path / "image" / "testbed" / "pkg" / "a.py").write_text("x = 1\n")
    dest = tmp_path / "base"
    ContainerBackend("docker", str(bin_dir / "docker")).export_repo("img:1", "/testbed", dest)
    assert (dest / "pkg" / "a.py").read_text() == "x = 1\n"
    kinds = [c[0] for c in calls()]
    assert kinds == ["create", "cp", "rm"]  # the created container is always removed


def test_missing_engine_is_unavailable_with_its_name():
    ok, why = ContainerBackend("apptainer", None).available()
    assert not ok and "apptainer" in why and "not installed" in why


@pytest.fixture
def nothing_isolated(monkeypatch):
    """bwrap and every container engine unavailable, each with its own reason."""
    reasons = {"bwrap": "no user namespaces", "podman": "no podman", "docker": "no daemon", "apptainer": "absent"}
    for name, why in reasons.items():
        monkeypatch.setattr(env_backends.get(name), "available", lambda why=why: (False, why))
    return reasons


def test_auto_never_degrades_silently(nothing_isolated):
    with pytest.raises(ConfigError) as err:
        resolve(EnvConfig(backend="auto"))
    msg = str(err.value)
    assert "workflow.shell.env.backend" in msg and "fallback" in msg
    assert all(why in msg for why in nothing_isolated.values())
    assert resolve(EnvConfig(backend="auto", fallback="process")).name == "process"  # only when allowed


def test_a_named_backend_that_cannot_start_is_refused(nothing_isolated):
    with pytest.raises(ConfigError, match="no daemon"):
        resolve(EnvConfig(backend="docker"))


def test_auto_prefers_bwrap_then_engines_in_order(nothing_isolated, monkeypatch):
    monkeypatch.setattr(env_backends.get("docker"), "available", lambda: (True, ""))
    assert resolve(EnvConfig()).name == "docker"
    monkeypatch.setattr(env_backends.get("bwrap"), "available", lambda: (True, ""))
    assert resolve(EnvConfig()).name == "bwrap"


@pytest.mark.parametrize(
    "cfg, key", [(EnvConfig(backend="nsjail"), "backend"), (EnvConfig(fallback="auto"), "fallback"),
                 (EnvConfig(warm=-1), "warm")])  # fmt: skip
def test_bad_env_config_names_the_key(cfg, key):
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert err.value.key == key  # relative: the config tree prefixes where it sits
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    assert err.value.key == f"workflow.shell.env.{key}"


def test_process_backend_runs_in_the_host_folder_and_kills_on_timeout(tmp_path):
    res = ProcessBackend().run("pwd; echo $AREAL_X", tmp_path, JailLimits(), "", "/testbed", {"AREAL_X": "7"})
    assert res.output.decode().split() == [str(tmp_path), "7"] and res.exit_code == 0
    res = ProcessBackend().run("sleep 30 & sleep 30", tmp_path, JailLimits(wall_seconds=0.5), "", "/t", {})
    assert res.timed_out and "process" in res.layers


def test_warm_pool_copies_are_fresh_and_the_base_is_made_once(tmp_path):
    made: list[str] = []
    lock = threading.Lock()

    def make_base(task, dest: Path) -> None:
        with lock:
            made.append(task.task_id)
        (dest / "src").mkdir()
        (dest / "src" / "m.py").write_text("def f():\n    return 1\n")
        os.symlink("src/m.py", dest / "link.py")

    class T:
        task_id = "t1"

    pool = WarmPool(make_base, workers=2)
    root = pool.root
    pool.prefetch(T, 3)
    copies = [pool.take(T)[0] for _ in range(4)]  # 3 prepared, 1 made on demand
    assert made == ["t1"] and len(set(copies)) == 4
    for c in copies:
        assert not filecmp.dircmp(pool.base(T), c).diff_files and (c / "link.py").is_symlink()
    (copies[0] / "src" / "m.py").write_text("changed")  # one episode's edit touches no other copy
    assert (copies[1] / "src" / "m.py").read_text() == "def f():\n    return 1\n"
    assert (pool.base(T) / "src" / "m.py").read_text() == "def f():\n    return 1\n"
    pool.close()
    assert not root.exists()


def test_warm_pool_never_waits_on_itself_when_every_worker_prefetches(tmp_path):
    # The shell agent prefetches a group's copies on a pool as wide as its episodes: each copy job waits
    # for the task's base, which therefore cannot be one more job queued on the same (full) pool.
    def make_base(task, dest: Path) -> None:
        (dest / "f.txt").write_text(task.task_id)

    class T:
        task_id = "t2"

    pool = WarmPool(make_base, workers=1)
    pool.prefetch(T, 2)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        takes = [ex.submit(pool.take, T) for _ in range(2)]
        paths = [f.result(timeout=60)[0] for f in takes]  # a deadlock would raise TimeoutError here
    assert [(p / "f.txt").read_text() for p in paths] == ["t2", "t2"]
    pool.close()


# ---- images: what each backend can use; `train --check` refuses a task set with unusable ones ----


@pytest.mark.parametrize("tool", ["docker", "podman"])
def test_container_check_image_asks_the_local_store_and_pulls_nothing(tool, fake_engine, monkeypatch):
    bin_dir, calls = fake_engine
    monkeypatch.setenv("FAKE_IMAGES", "swe/a:1,swe/b:2")
    be = ContainerBackend(tool, str(bin_dir / tool))
    assert be.check_image("swe/a:1") is None
    why = be.check_image("swe/c:3")
    assert f"not in {tool}'s local image store (Error: No such image: swe/c:3)" in why
    assert calls() == [["image", "inspect", "swe/a:1"], ["image", "inspect", "swe/c:3"]]  # no pull, no run
    monkeypatch.setenv("PATH", str(bin_dir / "none"))
    assert ContainerBackend(tool).check_image("swe/a:1") == f"{tool} is not installed (not on PATH)"


def test_unreachable_images_asks_once_per_distinct_image(fake_engine, monkeypatch):
    bin_dir, calls = fake_engine
    monkeypatch.setenv("FAKE_IMAGES", "ok:1")
    be = ContainerBackend("docker", str(bin_dir / "docker"))
    bad = env_backends.unreachable_images(be, ["x:1", "ok:1", "", "x:1", "y:1", "ok:1"])
    assert list(bad) == ["x:1", "y:1"] and all("No such image" in why for why in bad.values())
    assert sorted(c[2] for c in calls()) == ["ok:1", "x:1", "y:1"]


def test_apptainer_check_image_wants_a_local_sif_or_sandbox(tmp_path):
    (tmp_path / "img.sif").write_bytes(b"SIF")
    (tmp_path / "img.tar").write_bytes(b"tar")
    (tmp_path / "sandbox").mkdir()
    be = ContainerBackend("apptainer", "/nonexistent/apptainer")  # never run: the files alone decide
    assert be.check_image(str(tmp_path / "img.sif")) is None
    assert be.check_image(str(tmp_path / "sandbox")) is None
    for unusable in (str(tmp_path / "other.sif"), str(tmp_path / "img.tar"), "docker://swe/a:1"):
        assert "not a .sif file or a sandbox directory" in be.check_image(unusable)


def test_process_uses_no_image_and_bwrap_wants_a_local_root_filesystem(tmp_path):
    assert ProcessBackend().check_image("swe/anything:1") is None
    (tmp_path / "root" / "usr").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    bw = env_backends.BwrapBackend()
    assert bw.check_image(str(tmp_path / "root")) is None  # a prepared root filesystem
    assert "no such file or directory" in bw.check_image("swe/a:1")  # a registry reference
    assert "neither an OCI image layout" in bw.check_image(str(tmp_path / "empty"))


@pytest.mark.skipif(shutil.which("umoci") is None, reason="umoci not installed (apt-get install umoci)")
def test_bwrap_check_image_on_a_real_oci_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_NPU_CACHE", str(tmp_path / "cache"))
    lay = tmp_path / "layout"
    subprocess.run(["umoci", "init", "--layout", str(lay)], check=True, capture_output=True)
    subprocess.run(["umoci", "new", "--image", f"{lay}:t"], check=True, capture_output=True)
    bw = env_backends.BwrapBackend()
    assert bw.check_image(f"{lay}:t") is None
    assert "no manifest tagged 'u'" in bw.check_image(f"{lay}:u")
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools"))  # unpacking needs umoci: named, with its package
    assert "umoci is not installed" in bw.check_image(f"{lay}:t")


RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu" / "code_agent.yaml"


@pytest.fixture
def check(capsys, monkeypatch):
    """``areal-npu train recipes/cpu/code_agent.yaml --check OVERRIDES`` here: (exit code, stderr lines)."""
    monkeypatch.delenv("AREAL_NPU_DEVICE", raising=False)

    def run(*overrides):
        code = cli.main(["train", str(RECIPE), "--check", *overrides])
        return code, capsys.readouterr().err.strip().splitlines()

    yield run
    current_platform.cache_clear()


def _task_set(folder: Path, images: list) -> list[str]:
    """A SWE-bench-format JSONL with one instance per entry of ``images`` (None: a snapshot and no
    image); the overrides that train on all of it."""
    rows = []
    for i, image in enumerate(images):
        rows.append({"instance_id": f"t{i}", "problem_statement": "fix it", "test_command": "true"})
        if image is None:
            (folder / f"t{i}").mkdir()
        else:
            rows[-1]["image"] = image
    (folder / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["task.families=[]", "warmstart.steps=0", f"task.dataset={folder / 'set.jsonl'}",
            f"task.n_train={len(rows) - 1}", "task.n_eval=1"]  # fmt: skip


def test_check_refuses_a_task_set_whose_images_bwrap_cannot_use(check, tmp_path, monkeypatch):
    monkeypatch.setattr(env_backends.get("bwrap"), "available", lambda: (True, ""))  # images are the point
    (tmp_path / "root" / "usr").mkdir(parents=True)  # a prepared root filesystem: usable
    args = _task_set(tmp_path, [f"img-{i}" for i in range(7)] + ["img-0", "root", None])
    code, err = check(*args, "workflow.shell.env.backend=bwrap")
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("config error: task.dataset: 7 of 8 task images cannot be used by the bwrap backend")  # fmt: skip
    named = [f"img-{i}" for i in range(7) if f"img-{i}: no such file or directory" in err[0]]
    assert named == [f"img-{i}" for i in range(5)] and "; and 2 more" in err[0]  # 5 named, the rest counted
    assert err[0].count("img-0:") == 1 and str(tmp_path / "root") not in err[0]


def test_check_asks_the_container_engine_for_every_task_image(check, fake_engine, tmp_path, monkeypatch):
    bin_dir, calls = fake_engine
    monkeypatch.setattr(env_backends.get("docker"), "binary", str(bin_dir / "docker"))
    args = [*_task_set(tmp_path, ["swe/a:1", "swe/b:1", "swe/a:1", None]), "workflow.shell.env.backend=docker"]  # fmt: skip
    monkeypatch.setenv("FAKE_IMAGES", "swe/a:1")
    code, err = check(*args)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("config error: task.dataset: 1 of 2 task images cannot be used by the docker backend")  # fmt: skip
    assert "swe/b:1: not in docker's local image store (Error: No such image: swe/b:1)" in err[0]
    assert sorted(c[2] for c in calls() if c[:2] == ["image", "inspect"]) == ["swe/a:1", "swe/b:1"]
    assert not [c for c in calls() if c[0] in ("pull", "run", "create")]
    monkeypatch.setenv("FAKE_IMAGES", "swe/a:1,swe/b:1")
    assert check(*args) == (0, [])


def test_auto_without_bubblewrap_exits_2_at_check(fake_engine, tmp_path):
    """The CLI in a fresh process: bwrap is a site binary that cannot make namespaces (it prints what
    bwrap prints where unprivileged user namespaces are off; AREAL_NPU_BWRAP names it), and every
    container engine is installed without a daemon."""
    bin_dir, _ = fake_engine
    bwrap = bin_dir / "bwrap"
    bwrap.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the kernel "
                     "does not allow non-privileged user namespaces.' >&2\nexit 1\n")  # fmt: skip
    bwrap.chmod(0o755)
    env = {**os.environ, "AREAL_NPU_BWRAP": str(bwrap), "FAKE_DOWN": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    env.pop("AREAL_NPU_DEVICE", None)

    def run(*overrides):
        return subprocess.run([sys.executable, "-m", "areal_npu.cli", "train", str(RECIPE), "--check", *overrides],
                              capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip

    out = run()
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1, out.stderr
    assert err[0].startswith("config error: workflow.shell.env.backend: 'auto' cannot start here (")
    for reason in ("bwrap: bwrap cannot start a jail here: bwrap: No permissions to creating new namespace",
                   "podman: podman cannot run containers here: Cannot connect", "docker: docker cannot run",
                   "apptainer: apptainer cannot run", "set workflow.shell.env.fallback"):  # fmt: skip
        assert reason in err[0], reason


def test_check_passes_without_isolation_only_when_the_fallback_allows_it(check, nothing_isolated):
    code, err = check()
    assert code == 2 and err[0].startswith("config error: workflow.shell.env.backend: 'auto' cannot start")
    assert check("workflow.shell.env.fallback=process") == (0, [])
