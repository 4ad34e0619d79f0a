"""The SWE-smith-style task generator (areal_npu.agent.taskgen): planted bugs checked by executing the
mutated function against a reference written here, patches checked with git itself, the F2P/P2P
filter on synthetic status maps, and one offline end-to-end build of a tiny library made here."""

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from areal_npu.agent.taskgen import build, mutations, sdist, suite
from areal_npu.agent.taskgen.spec import load_spec, parse_spec
from areal_npu.agent.taskgen.statement import module_of, problem_statement
from areal_npu.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]


def _function(source: str, name: str = "f"):
    scope: dict = {}
    exec(compile(source, "<mutated>", "exec"), scope)
    return scope[name]


def _only(source: str, kind: str, new: str | None = None) -> mutations.Mutation:
    found = [
        m for m in mutations.candidates(source, "m.py") if m.kind == kind and (new is None or m.new == new)
    ]
    assert len(found) == 1, found
    return found[0]


# (source, kind, replacement text, reference for the mutated f, inputs)
BEHAVIOUR = [
    ("def f(a, b):\n    return a < b\n", "flip_comparison", "<=", lambda a, b: a <= b, [(1, 1), (1, 2), (2, 1)]),
    ("def f(a, b):\n    return a == b\n", "flip_comparison", "!=", lambda a, b: a != b, [(1, 1), (1, 2)]),
    ("def f(x, xs):\n    return x in xs\n", "flip_comparison", "not in", lambda x, xs: x not in xs,
     [(1, [1]), (2, [1])]),
    ("def f(xs):\n    return xs[1:]\n", "off_by_one", "2", lambda xs: xs[2:], [([1, 2, 3],), ([4],)]),
    ("def f(xs):\n    return xs[1:]\n", "off_by_one", "0", lambda xs: xs[0:], [([1, 2, 3],)]),
    ("def f(n):\n    return list(range(n))\n", "off_by_one", "n + 1", lambda n: list(range(n + 1)), [(0,), (3,)]),
    ("def f(x):\n    if x < 0:\n        x = -x\n    return x\n", "drop_branch", "", lambda x: x, [(-3,), (2,)]),
    ("def f(x):\n    if x > 0:\n        return 1\n    elif x < 0:\n        return -1\n    return 0\n",
     "drop_branch", "", lambda x: 1 if x > 0 else 0, [(-2,), (0,), (5,)]),
    ("def f(x, scale=2):\n    return x * scale\n", "wrong_default", "3", lambda x: x * 3, [(1,), (4,)]),
    ("def f(x, *, neg=False):\n    return -x if neg else x\n", "wrong_default", "True", lambda x: -x, [(2,)]),
    ("def f(a, b):\n    return a + b\n", "swap_operator", "-", lambda a, b: a - b, [(1, 2), (5, 3)]),
    ("def f(a, b):\n    return a and b\n", "swap_operator", "or", lambda a, b: a or b, [(0, 1), (1, 0)]),
    ("def f(a, b):\n    a += b\n    return a\n", "swap_operator", "-=", lambda a, b: a - b, [(1, 2)]),
    ("def f(a):\n    b = a * 2\n    c = b + 1\n    return b\n", "wrong_return", "c", lambda a: a * 2 + 1, [(3,)]),
]  # fmt: skip


@pytest.mark.parametrize(("source", "kind", "new", "reference", "inputs"), BEHAVIOUR)
def test_each_kind_changes_behaviour_as_described(source, kind, new, reference, inputs):
    m = _only(source, kind, new)
    original, mutated = _function(source), _function(mutations.apply(source, m))
    assert all(mutated(*args) == reference(*args) for args in inputs)
    assert any(mutated(*args) != original(*args) for args in inputs)


def test_edit_is_byte_precise_and_leaves_the_rest_identical():
    source = '# coding: utf-8\ndef f(s):\n    return "é€" * 2 if len(s) < 3 else s  # keep\n\nX = 1 + 2\n'
    m = _only(source, "flip_comparison")
    mutated = mutations.apply(source, m)
    assert mutated == source.replace("len(s) < 3", "len(s) <= 3")  # after multi-byte characters
    assert (m.line, m.qualname, m.old) == (3, "f", "<")
    # module-level code, string literals, asserts, f-strings and decorators are never mutated
    quiet = "import functools\n@functools.lru_cache(2)\ndef g(x):\n    assert x > 1\n    return f'{x + 1}' + 'a'\n"
    assert mutations.candidates(quiet, "q.py") == []
    with pytest.raises(ValueError, match="q.py"):
        mutations.candidates("def (:\n", "q.py")
    with pytest.raises(ValueError, match="no longer holds"):
        mutations.apply(source.replace("<", ">"), m)


def test_qualnames_follow_python():
    source = (
        "class C:\n    def m(self):\n        def inner(b):\n            return b + 1\n        return inner\n"
    )
    assert {m.qualname for m in mutations.candidates(source, "c.py")} == {
        _function(source, "C")().m().__qualname__
    }


def test_order_is_seeded_and_interleaves_kinds():
    source = "".join(
        f"def f{i}(a, b, c=1):\n    if a < b:\n        a = a + {i}\n    x = a and b\n    return a\n"
        for i in range(4)
    )
    found = mutations.candidates(source, "m.py")
    first = mutations.order(found, 7)
    assert first == mutations.order(list(reversed(found)), 7)  # a function of the set and the seed
    assert first != mutations.order(found, 8) and sorted(first, key=id) == sorted(found, key=id)
    kinds = {m.kind for m in found}
    assert {m.kind for m in first[: len(kinds)]} == kinds


def _git_repo(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "src"
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    return build._git_repo(src, tmp_path / "repo")


def test_gold_patch_and_test_patch_apply_with_git(tmp_path):
    source = "def f(a, b):\n    return a < b\n"  # no newline issues; one hunk
    repo = _git_repo(tmp_path, {"pkg/m.py": source, "tests/test_m.py": "def test_x():\n    pass\n"})
    buggy = mutations.apply(source, _only(source, "flip_comparison"))
    gold = build.gold_patch(repo, "pkg/m.py", buggy, source)
    assert (
        gold.startswith("diff --git a/pkg/m.py b/pkg/m.py\n")
        and "-    return a <= b\n+    return a < b\n" in gold
    )
    assert (repo / "pkg/m.py").read_text() == source and build.git(repo, "status", "--porcelain") == ""
    test_patch = build.added_files_patch(repo, ["tests/test_m.py"])
    assert "diff --git a/tests/test_m.py b/tests/test_m.py\nnew file mode" in test_patch
    agent = tmp_path / "agent"  # what the agent gets: the bug, no hidden test file
    (agent / "pkg").mkdir(parents=True)
    (agent / "pkg/m.py").write_text(buggy)
    for patch in (test_patch, gold):
        subprocess.run(["git", "apply", "-"], cwd=agent, input=patch, text=True, check=True)
    assert (agent / "pkg/m.py").read_bytes() == source.encode()
    assert (agent / "tests/test_m.py").read_text() == "def test_x():\n    pass\n"
    subprocess.run(["git", "apply", "-R", "-"], cwd=agent, input=gold, text=True, check=True)
    assert (agent / "pkg/m.py").read_bytes() == buggy.encode()


def test_split_tests_is_swe_smiths_filter():
    base = {"t/test_a.py::x", "t/test_a.py::y", "t/test_b.py::z"}
    mutated = {"t/test_a.py::x": "FAILED", "t/test_a.py::y": "PASSED", "t/test_b.py::z": "PASSED",
               "t/test_b.py::new": "FAILED"}  # fmt: skip
    f2p, p2p, why = suite.split_tests(base, mutated, ("t",), 5)
    assert (f2p, p2p, why) == (["t/test_a.py::x"], ["t/test_a.py::y", "t/test_b.py::z"], "")
    # a test missing from the log (its module failed to import) counts as failing
    assert suite.split_tests(base, {"t/test_a.py::y": "PASSED"}, ("t",), 5)[0] == [
        "t/test_a.py::x",
        "t/test_b.py::z",
    ]
    assert suite.split_tests(base, dict.fromkeys(base, "PASSED"), ("t",), 5)[2] == "no test failed"
    assert suite.split_tests(base, {}, ("t",), 2)[2] == "too many tests failed"
    assert (
        suite.split_tests({"pkg/m.py::pkg.m.f"}, {}, ("t",), 5)[2]
        == "a failing test is outside the suite's paths"
    )


def test_cap_pass_to_pass_keeps_the_hidden_files_first():
    p2p = [f"t/test_a.py::a{i}" for i in range(3)] + [f"t/test_b.py::b{i}" for i in range(10)]
    capped = suite.cap_pass_to_pass(p2p, {"t/test_a.py"}, 5, seed=1)
    assert (
        len(capped) == 5
        and {f"t/test_a.py::a{i}" for i in range(3)} <= set(capped)
        and capped == sorted(capped)
    )
    assert capped == suite.cap_pass_to_pass(p2p, {"t/test_a.py"}, 5, seed=1)
    assert suite.cap_pass_to_pass(p2p, set(), 100, seed=1) == sorted(p2p)


LOG = """\
=================================== FAILURES ===================================
___________________________________ test_one ___________________________________

    def test_one():
>       assert lib.f(2) == 3
E       assert 5 == 3
E        +  where 5 = <function f at 0x7f00deadbeef>(2)
E        +    where 2 = now(12, 31, 59)

t/test_a.py:3: AssertionError
____________________________ Suite.test_two[a b] _____________________________

    def test_two(self):
>       lib.g()

t/test_a.py:9:
_ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _ _

>       raise ValueError("planted line")
E       ValueError: boom

lib.py:4: ValueError
=========================== short test summary info ============================
PASSED t/test_a.py::test_zero
PASSED t/test_a.py::test_p[a b]
PASSED t/test_a.py::test_p[a c]
FAILED t/test_a.py::test_one - assert 5 == 3
FAILED t/test_a.py::Suite::test_two[a b] - ValueError: boom
========================= 2 failed, 3 passed in 0.01s ==========================
"""


def test_statuses_come_from_swebench_less_ambiguous_ids():
    # "test_p[a b]" and "test_p[a c]" are both cut to "t/test_a.py::test_p[a" by the parser: dropped
    assert suite.parse_statuses(LOG) == {"t/test_a.py::test_zero": "PASSED", "t/test_a.py::test_one": "FAILED",
                                         "t/test_a.py::Suite::test_two[a": "FAILED"}  # fmt: skip


def test_failure_excerpt_shows_the_test_line_and_error_not_library_lines():
    one = suite.failure_excerpt(LOG, "t/test_a.py::test_one")
    assert one.splitlines() == [">       assert lib.f(2) == 3", "E       assert 5 == 3",
                                "E        +  where 5 = <function f at 0x...>(2)"]  # fmt: skip
    two = suite.failure_excerpt(LOG, "t/test_a.py::Suite::test_two[a b]")
    assert two.splitlines() == [">       lib.g()", "E       ValueError: boom"] and "planted" not in two
    assert suite.failure_excerpt(LOG, "t/test_a.py::nothing") == ""


def test_problem_statement_names_the_symptom_never_the_fix():
    source = "def clamp(x, hi):\n    if x > hi:\n        return hi\n    return x\n"
    m = _only(source, "flip_comparison")
    text = problem_statement(
        m, "lib", "1.0", ["t/test_a.py::test_one"], {"t/test_a.py::test_one": "E  boom"}, 3
    )
    assert "`clamp`" in text and "test_one" in text and "E  boom" in text
    assert "x > hi" not in text and "x >= hi" not in text and m.description not in text and m.kind not in text
    assert text == problem_statement(
        m, "lib", "1.0", ["t/test_a.py::test_one"], {"t/test_a.py::test_one": "E  boom"}, 3
    )
    assert module_of("src/pkg/__init__.py") == "pkg" and module_of("pkg/sub/m.py") == "pkg.sub.m"


SPEC = """\
name: tiny
seed: 3
image: img
libraries:
  - name: tinylib
    version: "1.0"
    sha256: {sha}
    repo: example/tinylib
    source_files: [tinylib.py]
    test_paths: [tests]
    test_command: PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -m pytest -rA -p no:cacheprovider tests
"""


def test_spec_errors_name_the_key():
    good = SPEC.format(sha="a" * 64)
    assert parse_spec(good).libraries[0].slug == "tinylib"
    assert parse_spec(good).digest != parse_spec(good.replace("seed: 3", "seed: 4")).digest
    for text, key in [(SPEC.format(sha="xyz"), "libraries[0].sha256"), (good.replace("    repo: example/tinylib\n", ""),
                      "libraries[0].repo"), (good + "colour: red\n", "colour"),
                      (good.replace("[tinylib.py]", "[../x.py]"), "libraries[0].source_files")]:  # fmt: skip
        with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
            parse_spec(text)
    pinned = load_spec(REPO_ROOT / "recipes/tasks/pylibs.yaml")
    assert len(pinned.libraries) >= 3 and sum(lib.tasks for lib in pinned.libraries) >= 30


TINYLIB = '''\
def clamp(x, lo=0, hi=10):
    """x limited to [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x


def total(xs):
    s = 0
    for x in xs:
        s += x
    return s
'''
TINY_TESTS = {
    "tests/test_clamp.py": "from tinylib import clamp\n\ndef test_inside():\n    assert clamp(5) == 5\n\n"
    "def test_low():\n    assert clamp(-3) == 0\n\ndef test_high():\n    assert clamp(12) == 10\n\n"
    "def test_edges():\n    assert clamp(0) == 0 and clamp(10) == 10\n",
    "tests/test_total.py": "from tinylib import total\n\ndef test_total():\n    assert total([1, 2, 3]) == 6\n\n"
    "def test_empty():\n    assert total([]) == 0\n",
}


def _sdist(path: Path) -> str:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in {"tinylib.py": TINYLIB, **TINY_TESTS}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"tinylib-1.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_checks_the_pinned_hash_and_reuses_the_cache(tmp_path):
    made = tmp_path / "made.tar.gz"
    sha = _sdist(made)
    fake_pip = tmp_path / "fake_pip.py"  # stands in for `pip download`: copies the file to --dest
    fake_pip.write_text("import shutil, sys, pathlib\nd = pathlib.Path(sys.argv[sys.argv.index('--dest') + 1])\n"
                        f"d.mkdir(parents=True)\nshutil.copy({str(made)!r}, d / 'tinylib-1.0.tar.gz')\n"
                        "open(sys.argv[0] + '.calls', 'a').write('x')\n")  # fmt: skip
    lib = parse_spec(SPEC.format(sha=sha)).libraries[0]
    got = sdist.fetch(lib, tmp_path / "cache", pip=(sys.executable, str(fake_pip)))
    assert got.read_bytes() == made.read_bytes()
    assert sdist.fetch(lib, tmp_path / "cache", pip=(sys.executable, str(fake_pip))) == got
    assert Path(f"{fake_pip}.calls").read_text() == "x"  # the second call did not download
    wrong = parse_spec(SPEC.format(sha="b" * 64)).libraries[0]
    with pytest.raises(ValueError, match=r"tinylib-1.0.tar.gz: sha256 .* does not match the pinned bbbb"):
        sdist.fetch(wrong, tmp_path / "cache", pip=(sys.executable, str(fake_pip)))
    assert (sdist.extract(got, tmp_path / "x") / "tinylib.py").read_text() == TINYLIB


def test_host_runner_kills_a_suite_past_its_timeout(tmp_path):
    run = suite.host_runner()
    log, code = run(tmp_path, "echo started; sleep 60 & wait", timeout=0.5)
    assert code == suite.TIMEOUT_EXIT and "started" in log and "timed out" in log


@pytest.fixture(scope="module")
def tiny_set(tmp_path_factory):
    """A two-task set built offline from the tiny library above (its sdist put in the cache first)."""
    tmp = tmp_path_factory.mktemp("tiny")
    archive = tmp / "tinylib-1.0.tar.gz"
    sha = _sdist(archive)
    spec = parse_spec(
        SPEC.format(sha=sha).replace("seed: 3", "seed: 3\nmax_candidates: 12\ntasks_per_library: 2")
    )
    cache = tmp / "cache"
    (cache / "sdists" / "tinylib-1.0").mkdir(parents=True)
    archive.rename(cache / "sdists" / "tinylib-1.0" / archive.name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AREAL_NPU_CACHE", str(cache))
        result = build.build_taskset(spec, runner=suite.host_runner(), workers=2, progress=False)
        again = build.build_taskset(spec, runner=None, progress=False)  # reused: no runner needed
    return (
        result,
        again,
        [json.loads(line) for line in (result.path / "tasks.jsonl").read_text().splitlines()],
    )


def test_tiny_build_writes_swe_bench_rows_whose_patches_grade(tiny_set, tmp_path):
    result, again, rows = tiny_set
    assert result.path.name.startswith("tiny-") and again.reused and not result.reused
    assert [r["instance_id"] for r in rows] == ["tinylib__tinylib-0000", "tinylib__tinylib-0001"]
    assert (
        len({(r["mutation"]["file"], r["mutation"]["function"]) for r in rows}) == 2
    )  # one bug per function
    runner = suite.host_runner()
    for row in rows:
        f2p, p2p = json.loads(row["FAIL_TO_PASS"]), json.loads(row["PASS_TO_PASS"])
        snapshot = result.path / row["snapshot"]
        hidden = {suite.test_file(t) for t in f2p}
        assert f2p and all(not (snapshot / h).exists() for h in hidden)  # the agent never sees them
        assert (snapshot / "tinylib.py").read_text() != TINYLIB
        for patches, want_f2p in (((), False), (("test_patch",), False), (("test_patch", "patch"), True)):
            work = tmp_path / f"{row['instance_id']}-{len(patches)}"
            subprocess.run(["cp", "-r", str(snapshot), str(work)], check=True)
            for name in patches:
                subprocess.run(["git", "apply", "-"], cwd=work, input=row[name], text=True, check=True)
            statuses = suite.parse_statuses(runner(work, row["test_command"])[0])
            assert all((statuses.get(t) == "PASSED") == want_f2p for t in f2p)
            if patches:
                assert all(statuses.get(t) == "PASSED" for t in p2p)
        assert (work / "tinylib.py").read_text() == TINYLIB  # gold gives back the original bytes
    report = result.reports[0]
    assert report.kept == 2 and report.tests == 6 and report.tried >= 2


@pytest.mark.slow
def test_real_library_from_pypi(tmp_path):
    """One real pinned library (toolz, ~180 tests) end to end: needs PyPI or a filled sdist cache."""
    spec = load_spec(REPO_ROOT / "recipes/tasks/pylibs.yaml")
    lib = next(lib for lib in spec.libraries if lib.name == "toolz")
    try:
        sdist.fetch(lib, build.cache_root() / "sdists")
    except RuntimeError as exc:
        pytest.skip(f"no PyPI and no cached sdist: {exc}")
    one = type(spec)(**{**vars(spec), "libraries": (lib,), "max_candidates": 12})
    result = build.build_taskset(
        one, out=tmp_path / "set", runner=suite.host_runner(), max_per_lib=2, progress=False
    )
    rows = (result.path / "tasks.jsonl").read_text().splitlines()
    assert len(rows) == 2 and all(json.loads(r)["FAIL_TO_PASS"] != "[]" for r in rows)


def test_jail_runner_reports_output_and_exit_code_and_refuses_a_bad_root(tmp_path):
    from areal_npu.agent.jail import backend

    ok, why = backend("bwrap").available()
    if not ok:
        pytest.skip(f"no bubblewrap here: {why}")
    (tmp_path / "marker.txt").write_text("seen\n")
    log, code = suite.jail_runner()(tmp_path, "cat marker.txt; pwd; exit 3")
    assert (log.split(), code) == (["seen", "/testbed"], 3)
    with pytest.raises(RuntimeError, match="not a root filesystem"):
        suite.jail_runner(root=tmp_path)(tmp_path, "true")
