"""Task root filesystems from OCI images, unpacked by the project itself: no daemon, no registry.

R2E-Gym and SWE-bench ship one container image per instance. A cluster user fetches them once
(``skopeo copy docker://... oci:DIR:tag``, or ``docker save``) and every node then runs them rootless
under bubblewrap (:mod:`areal_npu.agent.jail`, ``root=``). A source is one of:

- an OCI image layout directory (``oci-layout`` + ``index.json``); ``DIR:tag`` picks a ref, else the
  only (or first) manifest;
- an OCI archive (a tar holding ``oci-layout``) or a ``docker save`` tarball (a tar holding
  ``manifest.json``; docker >= 25 writes both, and is read as a docker archive);
- a root filesystem directory the user prepared (debootstrap, a Python environment): used as is.

Images are unpacked with ``umoci unpack --rootless`` (which applies the layers' whiteouts); archives
are first turned into a layout with ``skopeo copy``. Each image is unpacked once per machine into
``$AREAL_NPU_CACHE/rootfs/<digest>``: built in a temporary directory, renamed into place under a lock,
so concurrent callers (the warm pool, several trainers) never see half a tree.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

KINDS = ("oci-layout", "oci-archive", "docker-archive", "rootfs")
JAIL_MOUNT_POINTS = ("testbed", "tmp", "proc", "dev")  # what the jail mounts on a task's root
INSTALL_HINT = "apt-get install umoci skopeo"
REF_ANNOTATION = "org.opencontainers.image.ref.name"
TOOL_TIMEOUT_S = 3600.0  # unpacking a multi-GB instance image takes minutes, not hours


class MissingTool(RuntimeError):
    """A command-line tool the image handling needs is not installed."""


@dataclass(frozen=True)
class ImageSource:
    kind: str  # one of KINDS
    path: Path
    tag: str | None = None  # the ref picked in an OCI layout (None: the only or first manifest)


def cache_root() -> Path:
    return Path(os.environ.get("AREAL_NPU_CACHE") or Path.home() / ".cache" / "areal-npu")


def tool(name: str) -> str:
    """The tool's path; a missing one names the Debian package, since that is the fix."""
    found = shutil.which(name)
    if found is None:
        raise MissingTool(f"{name} is not installed (needed to unpack OCI images): {INSTALL_HINT}")
    return found


def run_tool(argv: list[str], timeout: float = TOOL_TIMEOUT_S) -> None:
    """Runs one umoci/skopeo command; its stderr goes into the error. (Tests count calls through here.)"""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:  # subprocess.run has killed it
        raise RuntimeError(f"{' '.join(argv)} ran past {timeout:.0f} s") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")


def _tar_members(path: Path, wanted: tuple[str, ...]) -> dict[str, bytes] | None:
    """The named top-level members of a tarball (None when ``path`` is not a tarball). Reads headers
    only, plus the wanted members."""
    try:
        with tarfile.open(path, "r:*") as tar:
            found = {}
            for member in tar:
                name = member.name.removeprefix("./")
                if name in wanted and member.isfile():
                    found[name] = tar.extractfile(member).read()
            return found
    except (tarfile.TarError, OSError, EOFError):
        return None


def _refs(layout: Path) -> list[tuple[str | None, str]]:
    """(ref name or None, manifest digest) for each manifest of a layout's index, in order."""
    try:
        index = json.loads((layout / "index.json").read_text())
        return [(m.get("annotations", {}).get(REF_ANNOTATION), m["digest"]) for m in index["manifests"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{layout}: unreadable OCI index.json ({type(exc).__name__}: {exc})") from exc


def _is_layout(path: Path) -> bool:
    return path.is_dir() and (path / "oci-layout").is_file() and (path / "index.json").is_file()


def parse(source: str | Path) -> ImageSource:
    """What kind of image source ``source`` is; ValueError naming the path when it is none of them."""
    text = str(source)
    path, tag = Path(text), None
    if not path.exists() and ":" in text:
        head, _, suffix = text.rpartition(":")
        if suffix and "/" not in suffix and _is_layout(Path(head)):
            path, tag = Path(head), suffix
    if not path.exists():
        raise ValueError(f"{text}: no such file or directory (expected an OCI image layout, an OCI or "
                         "docker-save tarball, or a root filesystem directory)")  # fmt: skip
    if _is_layout(path):
        refs = _refs(path)
        if not refs:
            raise ValueError(f"{path}: the OCI layout's index.json lists no manifest")
        if tag is not None and tag not in [name for name, _ in refs]:
            raise ValueError(f"{path}: no manifest tagged {tag!r} (tags: {[n for n, _ in refs if n]})")
        return ImageSource("oci-layout", path, tag)
    if path.is_dir():
        if (path / "usr").is_dir() or (path / "bin").exists():
            return ImageSource("rootfs", path)
        raise ValueError(f"{path}: a directory that is neither an OCI image layout (oci-layout + index.json) "
                         "nor a root filesystem (usr/ or bin/)")  # fmt: skip
    members = _tar_members(path, ("manifest.json", "oci-layout"))
    if members is None or not members:
        raise ValueError(f"{path}: not an image tarball (expected a tar holding oci-layout or manifest.json)")
    return ImageSource("docker-archive" if "manifest.json" in members else "oci-archive", path)


def describe(source: str | Path) -> str:
    """The kind of image source: one of :data:`KINDS`."""
    return parse(source).kind


def _oci_archive_manifest(path: Path) -> dict:
    """The descriptor of an OCI archive's first manifest (the one used, as for a layout)."""
    try:
        descriptor = json.loads((_tar_members(path, ("index.json",)) or {})["index.json"])["manifests"][0]
        str(descriptor["digest"])
        return descriptor
    except (KeyError, ValueError, IndexError, TypeError) as exc:
        raise ValueError(f"{path}: OCI archive without a readable index.json") from exc


def _digest_key(digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    if not (algorithm.isalnum() and hexdigest.isalnum()):
        raise ValueError(f"malformed digest {digest!r}")
    return f"{algorithm}-{hexdigest}"


def _pick(refs: list[tuple[str | None, str]], tag: str | None) -> tuple[str | None, str]:
    return next((r for r in refs if r[0] == tag), refs[0]) if tag is not None else refs[0]


def cache_key(src: ImageSource) -> str:
    """The directory name an image unpacks to: its manifest digest (layouts, OCI archives) or its
    image ID (docker archives, which carry no manifest digest); both name the content exactly."""
    if src.kind == "oci-layout":
        return _digest_key(_pick(_refs(src.path), src.tag)[1])
    if src.kind == "oci-archive":
        return _digest_key(_oci_archive_manifest(src.path)["digest"])
    if src.kind == "docker-archive":
        members = _tar_members(src.path, ("manifest.json",)) or {}
        try:
            config = json.loads(members["manifest.json"])[0]["Config"]
        except (KeyError, ValueError, IndexError, TypeError) as exc:
            raise ValueError(f"{src.path}: docker archive without a readable manifest.json") from exc
        config_bytes = (_tar_members(src.path, (config,)) or {}).get(config)
        if config_bytes is None:
            raise ValueError(f"{src.path}: docker archive lacks its image config {config}")
        return "sha256-" + hashlib.sha256(config_bytes).hexdigest()
    raise ValueError(f"{src.path}: {src.kind} is not an image")


def _tools_for(src: ImageSource) -> tuple[str, ...]:
    if src.kind == "rootfs":
        return ()
    if src.kind == "oci-layout" and _pick(_refs(src.path), src.tag)[0] is not None:
        return ("umoci",)
    return ("skopeo", "umoci")  # archives, and untagged layouts, go through skopeo first


def check(source: str | Path, cache_dir: Path | None = None) -> str | None:
    """Why ``source`` cannot be used (None when it can). Cheap: reads index/manifest files only, so
    ``--check`` can run it for every task before anything is allocated."""
    try:
        src = parse(source)
        if src.kind == "rootfs":
            return None
        if ((cache_dir or cache_root()) / "rootfs" / cache_key(src) / "rootfs").is_dir():
            return None  # already unpacked: no tool needed
        for name in _tools_for(src):
            tool(name)
    except (ValueError, MissingTool) as exc:
        return str(exc)
    return None


def make_mount_points(root: Path) -> None:
    """The directories the jail mounts on (an image may lack /testbed, or even /proc)."""
    for name in JAIL_MOUNT_POINTS:
        target = root / name
        if not target.exists() and not target.is_symlink():
            target.mkdir(mode=0o1777 if name == "tmp" else 0o755)


def _unpack_into(src: ImageSource, work: Path) -> Path:
    """Unpacks ``src`` as the umoci bundle ``work/bundle``; returns the bundle."""
    layout, tag = src.path, _pick(_refs(src.path), src.tag)[0] if src.kind == "oci-layout" else None
    if tag is None:  # an archive, or a layout whose manifest has no ref name: skopeo makes a tagged one
        ref = f"{'oci' if src.kind == 'oci-layout' else src.kind}:{src.path}"  # skopeo's transport names
        if src.kind == "oci-archive":
            name = _oci_archive_manifest(src.path).get("annotations", {}).get(REF_ANNOTATION)
            ref += f":{name}" if name else ""
        layout, tag = work / "layout", "img"
        run_tool([tool("skopeo"), "--insecure-policy", "copy", "--quiet", ref, f"oci:{layout}:{tag}"])
    bundle = work / "bundle"
    run_tool([tool("umoci"), "unpack", "--rootless", "--image", f"{layout}:{tag}", str(bundle)])
    make_mount_points(bundle / "rootfs")
    return bundle


def unpack(source: str | Path, cache_dir: Path | None = None) -> Path:
    """A root filesystem directory for ``source`` (unpacked once into the cache; see the module doc).
    A prepared root filesystem is returned as it is; an unpacked one needs no tool installed."""
    src = parse(source)
    if src.kind == "rootfs":
        return src.path
    store = (cache_dir or cache_root()) / "rootfs"
    store.mkdir(parents=True, exist_ok=True)
    key = cache_key(src)
    final = store / key
    if (final / "rootfs").is_dir():
        return final / "rootfs"
    with open(store / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if we die
        if (final / "rootfs").is_dir():  # another caller built it while we waited
            return final / "rootfs"
        for stale in store.glob(f".{key}.*"):  # a builder that died while holding this lock
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=store))
        try:
            bundle = _unpack_into(src, work)
            os.rename(bundle, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final / "rootfs"
