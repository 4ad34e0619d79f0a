"""Pinned source distributions from PyPI: ``pip download`` once into a cache, checked against the
pinned sha256 (a re-uploaded or tampered file must stop the build, not silently change the tasks),
then unpacked with tarfile's ``data`` filter (no links or paths outside the destination).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from areal_npu.agent.taskgen.spec import LibrarySpec
from areal_npu.digest import sha256_of

PIP_TIMEOUT_S = 600.0
_ARCHIVES = (".tar.gz", ".tgz", ".zip", ".tar.bz2")


def _checked(path: Path, lib: LibrarySpec) -> Path:
    got = sha256_of(path)
    if got != lib.sha256:
        raise ValueError(
            f"{path}: sha256 {got} does not match the pinned {lib.sha256} of {lib.name}=={lib.version} "
            "(libraries[].sha256 in the task-set description)"
        )
    return path


def fetch(lib: LibrarySpec, cache: Path, pip: tuple[str, ...] = (sys.executable, "-m", "pip")) -> Path:
    """The sdist of ``lib`` under ``cache/<name>-<version>/``: downloaded by pip when absent, and its
    sha256 checked every time (a cached file that changed raises too)."""
    folder = cache / f"{lib.slug}-{lib.version}"
    present = [p for p in folder.glob("*") if p.name.endswith(_ARCHIVES)] if folder.is_dir() else []
    if present:
        return _checked(present[0], lib)
    cache.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{lib.slug}-", dir=cache))
    try:
        argv = [*pip, "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
                "--dest", str(work / "dl"), f"{lib.name}=={lib.version}"]  # fmt: skip
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"pip download {lib.name}=={lib.version} ran past {PIP_TIMEOUT_S:.0f} s"
            ) from exc
        files = sorted((work / "dl").glob("*")) if (work / "dl").is_dir() else []
        if proc.returncode != 0 or len(files) != 1:
            raise RuntimeError(f"pip download {lib.name}=={lib.version} failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[-1500:]}")  # fmt: skip
        _checked(files[0], lib)
        (work / "final").mkdir()
        os.replace(files[0], work / "final" / files[0].name)
        try:
            os.rename(work / "final", folder)
        except OSError:  # another builder got there first; its file is checked like ours
            pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return fetch(lib, cache, pip)


def extract(archive: Path, dest: Path) -> Path:
    """Unpacks ``archive`` into the empty folder ``dest``; returns the sdist's single top folder."""
    dest.mkdir(parents=True, exist_ok=True)
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            for name in z.namelist():
                if name.startswith("/") or ".." in Path(name).parts:
                    raise ValueError(f"{archive}: member {name!r} leaves the folder")
            z.extractall(dest)
    else:
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
    tops = [p for p in dest.iterdir()]
    if len(tops) != 1 or not tops[0].is_dir():
        raise ValueError(f"{archive}: an sdist holds one top folder; found {sorted(p.name for p in tops)}")
    return tops[0]
