"""The environment image of the generated Python task sets, built from Debian packages as an OCI layout.

Why Debian packages rather than the host's interpreter: a task's tests must run in an environment
named by versions (recorded in the image and in its manifest), the same on every machine, and never
the trainer's own Python. Why not debootstrap: it needs root and runs maintainer scripts. Here the
packages and their dependency closure are resolved the way ``apt-get install`` would (one provider
per alternative), fetched with ``apt-get download``, unpacked with ``dpkg -x`` (no maintainer
scripts), and the few things those scripts do that matter are done by hand (merged /usr, the awk
alternative, byte-compiled modules, users). ``umoci`` packs the tree into one layer.

    python -m areal_npu.agent.debian_image OUT_LAYOUT   # prints the manifest digest
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from areal_npu.agent.jail import JailLimits, Mount, backend
from areal_npu.agent.rootfs import REF_ANNOTATION, make_mount_points, run_tool, tool

DEFAULT_PACKAGES = (
    "python3", "python3-pytest", "python-is-python3",  # Debian 12: Python 3.11, pytest 7.2
    "dash", "coreutils", "sed", "grep", "mawk", "findutils", "diffutils", "patch",  # what agents run
)  # fmt: skip
RECIPE_VERSION = 1  # bump when the build below changes what an image holds for the same packages
PACKAGES_FILE = "etc/areal-npu-packages.txt"  # inside the image: one name=version a line
KEY_ANNOTATION = "org.areal-npu.packages-sha256"
PACKAGES_ANNOTATION = "org.areal-npu.packages"
MERGED_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # Debian 12 is merged-/usr
DROPPED_DIRS = (
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
)  # as slim images do
ALTERNATIVES = {"usr/bin/awk": "mawk", "usr/bin/nawk": "mawk"}  # what mawk's postinst registers
USERS = {"passwd": "root:x:0:0:root:/root:/bin/sh\nagent:x:1000:1000:agent:/tmp:/bin/sh\n",
         "group": "root:x:0:\nagent:x:1000:\n"}  # fmt: skip  # uid 1000: the jail's user
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _apt(argv: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(
        argv, capture_output=True, text=True, cwd=cwd, stdin=subprocess.DEVNULL, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def ensure_apt_lists() -> None:
    """``apt-get update`` only on a machine that has never fetched the package lists."""
    policy = _apt(["apt-cache", "policy", "python3"])
    if "Candidate:" not in policy or "Candidate: (none)" in policy:
        _apt(["apt-get", "update"])


def parse_simulation(text: str) -> list[tuple[str, str]]:
    """(package, version) of every ``Inst`` line of ``apt-get -s install``, in its order."""
    pinned = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "Inst":
            version = parts[3] if parts[2].startswith("[") else parts[2]  # "Inst p [old] (new ...)"
            pinned.append((parts[1], version.lstrip("(")))
    return pinned


def resolve(packages: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """The packages and their whole Depends/Pre-Depends closure, pinned to the archive's candidates.
    Simulated against an empty dpkg database, so it is what an install on an empty root would pull
    in, with one provider picked per alternative (``apt-cache depends --recurse`` follows them all and
    drags perl in through mailcap's alternatives)."""
    ensure_apt_lists()
    out = _apt(["apt-get", "install", "-s", "-q", "--no-install-recommends", "-o", "Dir::State::status=/dev/null",
                "-o", "Debug::NoLocking=1", *packages])  # fmt: skip
    pinned = parse_simulation(out)
    names = {name.split(":")[0] for name, _ in pinned}
    missing = [p for p in packages if p.split("=")[0].split(":")[0] not in names]
    if missing:
        raise RuntimeError(f"apt resolved no package for {missing}: {out[-1000:]}")
    return sorted(pinned)


def packages_key(pinned: list[tuple[str, str]]) -> str:
    text = f"recipe={RECIPE_VERSION}\n" + "".join(f"{n}={v}\n" for n, v in sorted(pinned))
    return hashlib.sha256(text.encode()).hexdigest()


def download(pinned: list[tuple[str, str]], dest: Path) -> list[Path]:
    """The .deb files of exactly these versions. APT::Sandbox::User=root: apt's _apt user could not
    write ``dest`` (and would only print a warning about it)."""
    dest.mkdir(parents=True, exist_ok=True)
    _apt(
        ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", *[f"{n}={v}" for n, v in pinned]],
        cwd=dest,
    )
    debs = sorted(dest.glob("*.deb"))
    if len(debs) != len(pinned):
        raise RuntimeError(
            f"apt-get download fetched {len(debs)} files for {len(pinned)} packages into {dest}"
        )
    return debs


def _merge_into(src: Path, dst: Path) -> None:
    """Moves ``src``'s entries into ``dst`` (directories merged; on a clash the /usr copy stays)."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        target = dst / entry.name
        if entry.is_dir() and not entry.is_symlink() and target.is_dir() and not target.is_symlink():
            _merge_into(entry, target)
        elif not target.exists() and not target.is_symlink():
            os.rename(entry, target)
    shutil.rmtree(src)


def merge_usr(root: Path) -> None:
    """/bin, /lib ... become links into /usr, as on an installed Debian 12 (``dpkg -x`` writes real
    directories over any link that was there)."""
    for name in MERGED_DIRS:
        top = root / name
        if top.is_dir() and not top.is_symlink():
            _merge_into(top, root / "usr" / name)
        if (root / "usr" / name).is_dir() and not top.is_symlink():
            top.symlink_to(f"usr/{name}")


def fix_up(root: Path, pinned: list[tuple[str, str]]) -> None:
    """What maintainer scripts and an installer would have left that the tasks rely on."""
    merge_usr(root)
    for rel in DROPPED_DIRS:
        shutil.rmtree(root / rel, ignore_errors=True)
    for link, target in ALTERNATIVES.items():
        if (root / link).parent.joinpath(target).exists() and not os.path.lexists(root / link):
            (root / link).symlink_to(target)
    if not os.path.lexists(root / "usr/bin/python3"):  # the python3 package ships it; be sure
        found = sorted((root / "usr/bin").glob("python3.[0-9]*"))
        if found:
            (root / "usr/bin/python3").symlink_to(found[0].name)
    if not os.path.lexists(root / "bin/sh") and (root / "usr/bin/dash").exists():
        (root / "usr/bin/sh").symlink_to("dash")
    (root / "etc").mkdir(exist_ok=True)
    for name, text in USERS.items():
        if not (root / "etc" / name).exists():
            (root / "etc" / name).write_text(text)
    (root / PACKAGES_FILE).write_text("".join(f"{n}={v}\n" for n, v in sorted(pinned)))
    make_mount_points(root)


def byte_compile(root: Path) -> str:
    """Byte-compiles the image's Python modules with the image's own interpreter (what python3's
    postinst does): on the read-only root every test run would otherwise recompile what it imports.
    Returns "" or why it could not (the image still works, only slower)."""
    jail = backend("bwrap")
    ok, why = jail.available()
    if not ok:
        return why
    dirs = [str(Path("/") / p.relative_to(root)) for p in sorted((root / "usr/lib").glob("python3*"))]
    limits = JailLimits(wall_seconds=900, cpu_seconds=1800, cpu_cores=float(os.cpu_count() or 1),
                        memory_bytes=2 << 30, max_processes=256, disk_bytes=4 << 30)  # fmt: skip
    res = jail.run(["python3", "-m", "compileall", "-q", "-j", "0", *dirs], [Mount(root / "usr", "/usr", writable=True)],
                   limits, root=root)  # fmt: skip
    if res.error or res.exit_code not in (0, 1):  # 1: some file did not compile (e.g. lib2to3's test data)
        return res.error or f"compileall exit {res.exit_code}: {res.output[-500:].decode('utf-8', 'replace')}"
    return ""


def _manifest(layout: Path, tag: str) -> tuple[str, dict] | None:
    """(digest, annotations) of the manifest tagged ``tag`` in ``layout``, None when absent."""
    try:
        index = json.loads((layout / "index.json").read_text())
        desc = next(m for m in index["manifests"] if m.get("annotations", {}).get(REF_ANNOTATION) == tag)
        algorithm, _, hexdigest = desc["digest"].partition(":")
        manifest = json.loads((layout / "blobs" / algorithm / hexdigest).read_text())
        return desc["digest"], manifest.get("annotations", {})
    except (OSError, ValueError, KeyError, StopIteration, TypeError, AttributeError):
        return None


def image_packages(layout: Path, tag: str = "latest") -> list[str]:
    """The ``name=version`` list an image built here records in its manifest."""
    found = _manifest(layout, tag)
    return found[1].get(PACKAGES_ANNOTATION, "").split() if found else []


def pack(root: Path, layout: Path, tag: str, annotations: dict[str, str]) -> str:
    """Packs the tree ``root`` (consumed) as a one-layer image ``layout:tag``; returns its digest."""
    umoci = tool("umoci")
    bundle = layout.parent / f"{layout.name}.bundle"
    run_tool([umoci, "init", "--layout", str(layout)])
    run_tool([umoci, "new", "--image", f"{layout}:{tag}"])
    run_tool([umoci, "unpack", "--rootless", "--image", f"{layout}:{tag}", str(bundle)])
    (bundle / "rootfs").rmdir()
    os.rename(root, bundle / "rootfs")
    run_tool([umoci, "repack", "--history.created_by", "areal_npu.agent.debian_image", "--image", f"{layout}:{tag}",
              str(bundle)])  # fmt: skip
    config = ["--config.env", f"PATH={IMAGE_PATH}", "--config.env", "LANG=C.UTF-8", "--config.workingdir", "/testbed",
              "--config.cmd", "/bin/sh"]  # fmt: skip
    for key, value in annotations.items():
        config += ["--manifest.annotation", f"{key}={value}"]
    run_tool([umoci, "config", "--no-history", *config, "--image", f"{layout}:{tag}"])
    run_tool([umoci, "gc", "--layout", str(layout)])
    shutil.rmtree(bundle)
    found = _manifest(layout, tag)
    if found is None:
        raise RuntimeError(f"{layout}: umoci left no manifest tagged {tag!r}")
    return found[0]


def build_python_image(out_layout: Path, packages: tuple[str, ...] | list[str] = DEFAULT_PACKAGES,
                       tag: str = "latest") -> str:  # fmt: skip
    """Builds (or reuses) the image of ``packages`` at ``out_layout:tag``; returns the manifest digest.
    Reused when the layout already holds this package list at these versions (the archive's
    candidates now); otherwise rebuilt beside it and renamed over it under a lock."""
    out_layout = Path(out_layout).absolute()
    pinned = resolve(tuple(packages))
    key = packages_key(pinned)
    found = _manifest(out_layout, tag)
    if found and found[1].get(KEY_ANNOTATION) == key:
        return found[0]
    tool("umoci")
    out_layout.parent.mkdir(parents=True, exist_ok=True)
    with open(out_layout.parent / f"{out_layout.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _manifest(out_layout, tag)
        if found and found[1].get(KEY_ANNOTATION) == key:
            return found[0]
        work = Path(tempfile.mkdtemp(prefix=f".{out_layout.name}.build-", dir=out_layout.parent))
        try:
            root = work / "rootfs"
            root.mkdir()
            for deb in download(pinned, work / "debs"):
                _apt(["dpkg-deb", "-x", str(deb), str(root)])
            fix_up(root, pinned)
            why = byte_compile(root)
            if why:
                print(f"debian_image: modules left uncompiled: {why}", file=sys.stderr)
            annotations = {KEY_ANNOTATION: key, PACKAGES_ANNOTATION: " ".join(f"{n}={v}" for n, v in pinned)}
            digest = pack(root, work / "layout", tag, annotations)
            old = work / "old"
            if out_layout.exists():
                os.rename(out_layout, old)
            os.rename(work / "layout", out_layout)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layout", type=Path, help="the OCI layout directory to write (or reuse)")
    parser.add_argument("--tag", default="latest")
    parser.add_argument(
        "--package", action="append", help="a Debian package (repeat); default: the task-set set"
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    digest = build_python_image(args.layout, tuple(args.package or DEFAULT_PACKAGES), args.tag)
    size = sum(f.stat().st_size for f in args.layout.rglob("*") if f.is_file())
    print("\n".join(image_packages(args.layout, args.tag)), file=sys.stderr)
    print(
        f"{args.layout}:{args.tag} {size / 1e6:.1f} MB in {time.monotonic() - start:.1f} s", file=sys.stderr
    )
    print(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
