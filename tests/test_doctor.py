"""`areal-npu doctor`'s checks with their inputs faked: /proc and /sys files, the bwrap probe, the
cgroup opener, PATH and the installed packages; and the verdict line built from them."""

from areal_npu import doctor


def _files(contents: dict):
    return lambda path: contents.get(path)


def test_cores_are_the_affinity_capped_by_the_quota():
    assert doctor.cpu_cores(64, 2, None)["usable"] == 2  # a 2-core container on a 64-core host
    assert doctor.cpu_cores(8, 8, 2.5)["usable"] == 3  # 2.5 cores of quota: three run at once
    assert doctor.cpu_cores(None, None, None)["usable"] == 1


def test_cpu_quota_v2_and_v1():
    v2 = {"/proc/self/cgroup": "0::/box", "/sys/fs/cgroup/box/cpu.max": "150000 100000"}
    assert doctor.cpu_quota(_files(v2)) == 1.5
    assert doctor.cpu_quota(_files(v2 | {"/sys/fs/cgroup/box/cpu.max": "max 100000"})) is None
    v1 = {
        "/proc/self/cgroup": "4:memory:/m\n1:cpu,cpuacct:/job\n0::/",
        "/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "200000",
        "/sys/fs/cgroup/cpu/job/cpu.cfs_period_us": "100000",
    }
    assert doctor.cpu_quota(_files(v1)) == 2.0
    assert doctor.cpu_quota(_files(v1 | {"/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "-1"})) is None


def test_user_namespaces():
    off = {"/proc/sys/user/max_user_namespaces": "0"}
    assert not doctor.userns_check(_files(off), euid=0).ok
    debian = {"/proc/sys/kernel/unprivileged_userns_clone": "0"}
    assert not doctor.userns_check(_files(debian), euid=1000).ok
    assert doctor.userns_check(_files(debian), euid=0).ok  # root makes them regardless
    ubuntu = {"/proc/sys/kernel/apparmor_restrict_unprivileged_userns": "1"}
    check = doctor.userns_check(_files(ubuntu), euid=1000)
    assert not check.ok and "AppArmor" in check.detail and "AREAL_NPU_BWRAP" in check.detail
    assert doctor.userns_check(_files({}), euid=1000).ok


def test_bwrap_and_cgroups():
    assert doctor.bwrap_check("/usr/bin/bwrap", (True, "")).detail == "/usr/bin/bwrap: starts a jail"
    failed = doctor.bwrap_check(None, (False, "no bwrap binary"))
    assert not failed.ok and failed.detail == "no bwrap binary"

    removed = []

    class Group:
        kind = "v2"

        def kill_and_remove(self):
            removed.append(True)

    ok = doctor.cgroup_check(lambda limits: (Group(), ""))
    assert ok.ok and "cgroup v2, delegated" in ok.detail and removed == [True]
    no = doctor.cgroup_check(lambda limits: (None, "cgroup v2 group / does not delegate cpu to children"))
    assert not no.ok and "does not delegate cpu" in no.detail


def test_launcher_tools(tmp_path):
    def spec(found):
        return lambda module: object() if found else None

    assert doctor.tool_check("ray", "ray", "x", lambda n: "/opt/bin/ray", spec(True)).detail == "/opt/bin/ray"
    missing = doctor.tool_check("ray", "ray", "x", lambda n: None, spec(False))
    assert not missing.ok and "ray package is not installed" in missing.detail
    # a package without its command (and no copy beside the interpreter)
    no_cmd = doctor.tool_check("no-such-tool", "ray", "x", lambda n: None, spec(True))
    assert not no_cmd.ok and "no no-such-tool command" in no_cmd.detail


def _report(**over):
    ok = [{"name": n, "ok": True, "detail": "", "needed_for": f"{n} use"} for n in ("bubblewrap", "ray")]
    report = {"problems": [], "paths": {"rollout": "vllm-cpu"}, "device": "cpu", "device_count": 1,
              "cpu": {"usable": 2}, "checks": ok}  # fmt: skip
    return report | over


def test_verdict_line():
    assert doctor.verdict(_report()) == (
        "verdict: ready to train (cpu, 2 cores); the code agent's sandbox and both launchers work here"
    )
    checks = [{"name": "bubblewrap", "ok": False, "detail": "", "needed_for": "the sandbox"}]
    assert (
        doctor.verdict(_report(checks=checks))
        == "verdict: ready to train (cpu, 2 cores); not here: the sandbox (bubblewrap)"
    )
    blocked = _report(
        paths={"rollout": "unavailable (pip install areal-npu[cpu])"}, problems=["hook missing"]
    )
    assert doctor.verdict(blocked) == (
        "verdict: NOT READY: hook missing; rollout engines unavailable (pip install areal-npu[cpu])"
    )
    assert doctor.verdict(_report(device="npu", device_count=16)).startswith(
        "verdict: ready to train (npu x16)"
    )
