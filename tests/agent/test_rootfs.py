"""Task root filesystems from OCI images (areal_npu.agent.rootfs) and the Debian-built Python image
(areal_npu.agent.debian_image), with the real tools: umoci, skopeo, apt-get, dpkg-deb, bubblewrap.

The reference for an unpacked tree is the image's own layer tarballs, applied here with tarfile
(whiteouts included), not what umoci reports."""

import json
import os
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path

import pytest

from areal_npu.agent import debian_image, rootfs
from areal_npu.agent.jail import JailLimits, Mount, backend

TOOLS_MISSING = [t for t in ("umoci", "skopeo", "apt-get", "dpkg-deb") if shutil.which(t) is None]
# CI installs the tools: there a missing one fails the tests (with rootfs's own message) instead of skipping
pytestmark = pytest.mark.skipif(
    bool(TOOLS_MISSING) and not os.environ.get("CI"),
    reason=f"{', '.join(TOOLS_MISSING)} not installed (apt-get install umoci skopeo)",
)
JAIL_OK, JAIL_WHY = backend("bwrap").available()
needs_jail = pytest.mark.skipif(not JAIL_OK, reason=f"no bwrap jail on this machine: {JAIL_WHY}")
TAG = "t"


def _sh(*argv: str, cwd: Path | None = None) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, cwd=cwd).stdout


@pytest.fixture(scope="module")
def busybox_tree(tmp_path_factory) -> Path:
    """busybox-static from the Debian archive, unpacked with dpkg-deb (the binary at /bin/busybox)."""
    work = tmp_path_factory.mktemp("busybox")
    _sh("apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", "busybox-static", cwd=work)
    tree = work / "tree"
    _sh("dpkg-deb", "-x", str(next(work.glob("busybox-static_*.deb"))), str(tree))
    shutil.rmtree(tree / "usr" / "share")
    (tree / "bin" / "sh").symlink_to("busybox")
    return tree


@pytest.fixture(scope="module")
def layout(tmp_path_factory, busybox_tree) -> Path:
    """A two-layer image made with umoci: layer 1 = busybox + etc/{doomed,kept}.txt; layer 2 deletes
    etc/doomed.txt (a whiteout) and adds etc/added.txt."""
    work = tmp_path_factory.mktemp("image")
    lay, bundle = work / "layout", work / "bundle"
    _sh("umoci", "init", "--layout", str(lay))
    _sh("umoci", "new", "--image", f"{lay}:{TAG}")
    _sh("umoci", "unpack", "--rootless", "--image", f"{lay}:{TAG}", str(bundle))
    shutil.copytree(busybox_tree, bundle / "rootfs", symlinks=True, dirs_exist_ok=True)
    (bundle / "rootfs" / "etc").mkdir()
    (bundle / "rootfs" / "etc" / "doomed.txt").write_text("doomed\n")
    (bundle / "rootfs" / "etc" / "kept.txt").write_text("kept\n")
    _sh("umoci", "repack", "--refresh-bundle", "--image", f"{lay}:{TAG}", str(bundle))
    (bundle / "rootfs" / "etc" / "doomed.txt").unlink()
    (bundle / "rootfs" / "etc" / "added.txt").write_text("added in layer 2\n")
    _sh("umoci", "repack", "--image", f"{lay}:{TAG}", str(bundle))
    _sh("umoci", "gc", "--layout", str(lay))
    return lay


def _layers(lay: Path) -> list[Path]:
    index = json.loads((lay / "index.json").read_text())
    blob = lambda digest: lay / "blobs" / digest.replace(":", "/")  # noqa: E731
    manifest = json.loads(blob(index["manifests"][0]["digest"]).read_text())
    return [blob(layer["digest"]) for layer in manifest["layers"]]


def _reference_tree(lay: Path) -> dict[str, bytes | str | None]:
    """path -> file bytes / "->target" / None (directory), by applying the layer tarballs in order."""
    tree: dict[str, bytes | str | None] = {}
    for layer in _layers(lay):
        with tarfile.open(layer) as tar:
            for m in tar:
                path = os.path.normpath(m.name.removeprefix("./"))
                head, base = os.path.split(path)
                if base.startswith(".wh."):
                    gone = os.path.join(head, base.removeprefix(".wh."))
                    tree = {p: v for p, v in tree.items() if p != gone and not p.startswith(gone + "/")}
                elif path != ".":
                    tree[path] = (
                        tar.extractfile(m).read() if m.isfile() else "->" + m.linkname if m.issym() else None
                    )
    return tree


def _tree(root: Path) -> dict[str, bytes | str | None]:
    out: dict[str, bytes | str | None] = {}
    for path in root.rglob("*"):
        rel = str(path.relative_to(root))
        out[rel] = (
            "->" + os.readlink(path) if path.is_symlink() else None if path.is_dir() else path.read_bytes()
        )
    return out


def _without_mount_points(tree: dict) -> dict:
    return {p: v for p, v in tree.items() if p.split("/")[0] not in rootfs.JAIL_MOUNT_POINTS}


def test_layout_unpacks_with_whiteouts(layout, tmp_path):
    layer_members = [tarfile.open(p).getnames() for p in _layers(layout)]
    assert len(layer_members) == 2
    assert any(n.endswith("etc/.wh.doomed.txt") for n in layer_members[1])  # the deletion is a whiteout
    assert rootfs.describe(layout) == rootfs.describe(f"{layout}:{TAG}") == "oci-layout"
    root = rootfs.unpack(f"{layout}:{TAG}", cache_dir=tmp_path)
    assert root.is_relative_to(tmp_path / "rootfs")
    got = _tree(root)
    expected = _reference_tree(layout)
    assert "etc/doomed.txt" not in got and got["etc/added.txt"] == b"added in layer 2\n"
    assert _without_mount_points(got) == expected
    assert all((root / name).is_dir() for name in rootfs.JAIL_MOUNT_POINTS)


def test_docker_and_oci_archives_unpack_to_the_same_tree(layout, tmp_path):
    docker_tar, oci_tar = tmp_path / "docker.tar", tmp_path / "oci.tar"
    _sh(
        "skopeo",
        "--insecure-policy",
        "copy",
        "-q",
        f"oci:{layout}:{TAG}",
        f"docker-archive:{docker_tar}:img:{TAG}",
    )
    _sh("skopeo", "--insecure-policy", "copy", "-q", f"oci:{layout}:{TAG}", f"oci-archive:{oci_tar}:{TAG}")
    assert rootfs.describe(docker_tar) == "docker-archive" and rootfs.describe(oci_tar) == "oci-archive"
    expected = _tree(rootfs.unpack(layout, cache_dir=tmp_path / "a"))
    for source in (docker_tar, oci_tar):
        assert _tree(rootfs.unpack(source, cache_dir=tmp_path / source.stem)) == expected


@needs_jail
def test_jail_runs_on_the_unpacked_image(layout, tmp_path):
    root = rootfs.unpack(layout, cache_dir=tmp_path / "cache")
    testbed = tmp_path / "testbed"
    testbed.mkdir()
    script = "cat /etc/added.txt; busybox | head -n 1; echo x > /x; echo rc=$?; echo ok > /testbed/out"
    res = backend("bwrap").run(["/bin/sh", "-c", script], [Mount(testbed, "/testbed", writable=True)], JailLimits(),
                               root=root)  # fmt: skip
    out = res.output.decode()
    assert res.error == "" and res.exit_code == 0, out
    assert out.startswith("added in layer 2\nBusyBox v1.")  # the image's busybox (the host has none at /bin)
    assert "rc=1" in out and not (root / "x").exists()
    assert (testbed / "out").read_text() == "ok\n"


def test_check_names_the_problem(layout, tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    assert str(missing) in rootfs.check(missing) and "no such file" in rootfs.check(missing)
    (tmp_path / "empty").mkdir()
    assert str(tmp_path / "empty") in rootfs.check(tmp_path / "empty")
    (tmp_path / "notes.txt").write_text("hello")
    assert f"{tmp_path / 'notes.txt'}: not an image tarball" in rootfs.check(tmp_path / "notes.txt")
    assert "'nosuchtag'" in rootfs.check(f"{layout}:nosuchtag")
    with pytest.raises(ValueError, match="nope"):
        rootfs.describe(missing)
    assert rootfs.check(layout, cache_dir=tmp_path) is None
    unpacked = rootfs.unpack(layout, cache_dir=tmp_path / "cached")
    monkeypatch.setenv("PATH", str(tmp_path))  # no umoci on it
    assert rootfs.check(layout, cache_dir=tmp_path / "cached") is None  # already unpacked: no tool needed
    assert rootfs.unpack(layout, cache_dir=tmp_path / "cached") == unpacked
    assert "apt-get install umoci skopeo" in rootfs.check(layout, cache_dir=tmp_path)
    with pytest.raises(rootfs.MissingTool, match="umoci"):
        rootfs.unpack(layout, cache_dir=tmp_path)


def test_prepared_rootfs_is_used_as_is(busybox_tree):
    assert rootfs.describe(busybox_tree) == "rootfs"
    assert rootfs.unpack(busybox_tree) == busybox_tree and rootfs.check(busybox_tree) is None


def test_cache_is_reused_and_concurrent_callers_share_one_unpack(layout, tmp_path, monkeypatch):
    calls: list[list[str]] = []
    real = rootfs.run_tool
    barrier = threading.Barrier(2)

    def counting(argv, timeout=rootfs.TOOL_TIMEOUT_S):
        calls.append(argv)
        return real(argv, timeout)

    monkeypatch.setattr(rootfs, "run_tool", counting)
    key = rootfs.cache_key(rootfs.parse(layout))
    (tmp_path / "rootfs").mkdir()
    (tmp_path / "rootfs" / f".{key}.leftover").mkdir()  # a builder that died mid-unpack
    results: list[Path] = []

    def worker():
        barrier.wait()
        results.append(rootfs.unpack(layout, cache_dir=tmp_path))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] == tmp_path / "rootfs" / key / "rootfs"
    assert [a[1] for a in calls] == ["unpack"]
    assert sorted(p.name for p in (tmp_path / "rootfs").iterdir()) == [key, f"{key}.lock"]
    assert _without_mount_points(_tree(results[0])) == _reference_tree(layout)
    inode = results[0].stat().st_ino
    assert rootfs.unpack(f"{layout}:{TAG}", cache_dir=tmp_path).stat().st_ino == inode
    assert len(calls) == 1


def test_parse_simulation_reads_apt_lines():
    text = (
        "NOTE: This is only a simulation!\n"
        "Inst libc6 (2.36-9+deb12u14 Debian:12.15/oldstable [amd64]) []\n"
        "Inst zlib1g [1:1.2.12] (1:1.2.13.dfsg-1+deb12u1 Debian-Security:12 [amd64])\n"
        "Conf libc6 (2.36-9+deb12u14 Debian:12.15/oldstable [amd64])\n"
    )
    assert debian_image.parse_simulation(text) == [
        ("libc6", "2.36-9+deb12u14"),
        ("zlib1g", "1:1.2.13.dfsg-1+deb12u1"),
    ]


@pytest.fixture(scope="module")
def python_image(tmp_path_factory) -> tuple[Path, str]:
    lay = tmp_path_factory.mktemp("pyimage") / "layout"
    return lay, debian_image.build_python_image(lay)


@needs_jail
def test_python_image_runs_pytest_in_the_jail(python_image, tmp_path, monkeypatch):
    lay, digest = python_image
    assert rootfs.describe(lay) == "oci-layout"
    recorded = dict(line.split("=", 1) for line in debian_image.image_packages(lay))
    assert {"python3", "python3-pytest", "dash", "coreutils", "patch"} <= set(recorded)
    root = rootfs.unpack(lay, cache_dir=tmp_path)
    assert root.parent.name == digest.replace(":", "-")
    assert (root / debian_image.PACKAGES_FILE).read_text().split() == debian_image.image_packages(lay)
    testbed = tmp_path / "testbed"
    testbed.mkdir()
    (testbed / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    script = "python3 -m pytest --version; python3 -m pytest -q -p no:cacheprovider; python3 -V; sh -c 'echo sh-ok'"
    res = backend("bwrap").run(["sh", "-c", script], [Mount(testbed, "/testbed", writable=True)], JailLimits(),
                               cwd="/testbed", root=root)  # fmt: skip
    out = res.output.decode()
    assert res.exit_code == 0, out
    assert f"pytest {recorded['python3-pytest'].split('-')[0]}" in out and "1 passed" in out
    assert f"Python {recorded['python3.11'].split('-')[0]}" in out and "sh-ok" in out
    calls = []
    monkeypatch.setattr(debian_image, "run_tool", lambda argv, timeout=0: calls.append(argv))
    assert debian_image.build_python_image(lay) == digest and calls == []  # same packages: reused
