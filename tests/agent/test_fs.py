"""remove_tree on what a jailed program can leave behind: unwritable directories and trees deeper than
Python's recursion limit. Reference: the path no longer exists, and nothing outside it is touched."""

import os
import sys

from areal_npu.agent.fs import remove_tree


def _deep(root, depth: int) -> None:
    fd = os.open(root, os.O_RDONLY)
    try:
        for _ in range(depth):  # mkdirat / openat: the path is never spelled out (it passes PATH_MAX)
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    finally:
        os.close(fd)


def test_a_tree_deeper_than_the_recursion_limit_is_removed(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("x")
    victim = tmp_path / "deep"
    victim.mkdir()
    _deep(victim, sys.getrecursionlimit() + 200)
    remove_tree(victim)
    assert not os.path.lexists(victim) and keep.read_text() == "x"


def test_unwritable_directories_are_removed(tmp_path):
    locked = tmp_path / "locked" / "inner"
    locked.mkdir(parents=True)
    (locked / "f").write_text("x")
    os.chmod(locked, 0)
    os.chmod(locked.parent, 0o500)
    remove_tree(tmp_path / "locked")
    assert not os.path.lexists(tmp_path / "locked")
