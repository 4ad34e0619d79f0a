"""Every command example in the README, docs/ and docker/README.md, and the examples in `--help`,
runs: `areal-npu train ...` through `--check` (or its own `--dry-run`), every other `areal-npu`
command and every `bash script` through `--help`. Commands are the lines of fenced bash blocks that
start (after `VAR=value` assignments) with `areal-npu`, `.venv/bin/areal-npu`, `bash ` or `scripts/`;
`text` blocks (synopses with placeholders) are not examples. The how-tos whose blocks build their own
inputs run whole in tests/test_howtos.py. In process: one import of the package, seconds in all."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from areal_npu import cli
from areal_npu.agent.jail import backend

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docker" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
#: run whole, with their inputs, by tests/test_howtos.py
RUN_WHOLE = {"docs/howto/own_model.md", "docs/howto/own_tasks.md", "docs/howto/custom_workflow.md"}
#: scripts that do the real work and take no --help: why each is not run here
SKIP = {
    "scripts/quickstart.sh": "sets up .venv and trains for minutes; CI runs a shortened quickstart in tests/test_train_e2e.py",
    "scripts/test.sh": "the whole suite (CI's entry point, .ci/run)",
}
COMMAND = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\.venv/bin/)?(areal-npu|bash\s|scripts/)")
JAIL_OK, JAIL_WHY = backend("bwrap").available()


def examples(path: Path) -> list[str]:
    """The command lines of ``path``'s fenced bash / sh / shell blocks (continuations joined,
    comments and heredoc bodies dropped)."""
    out, lang, heredoc, pending = [], None, None, ""
    for line in path.read_text().splitlines():
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and heredoc is None:
            lang = None if lang is not None else fence.group(1)
            continue
        if lang not in ("bash", "sh", "shell") or not line.strip():
            continue
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        here = re.search(r"<<-?\s*'?(\w+)'?", line)
        heredoc = here.group(1) if here else None
        line = pending + re.sub(r"\s+#\s.*$", "", line).strip()
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        pending = ""
        if COMMAND.match(line):
            out.append(line)
    return out


def all_examples() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), cmd) for p in DOCS for cmd in examples(p)]


def split(command: str) -> tuple[dict[str, str], list[str]]:
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[0].endswith("areal-npu"):
        words[0] = "areal-npu"
    return env, words


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # --help, or argparse refusing the command line
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_the_docs_have_examples_and_the_extractor_reads_blocks_as_bash_does(tmp_path):
    found = all_examples()
    files = {f for f, _ in found}
    assert {"README.md", "docs/howto/recipes.md", "docs/howto/code_agent.md", "docker/README.md"} <= files
    assert any(cmd.startswith("bash scripts/quickstart.sh") for _, cmd in found)
    doc = tmp_path / "x.md"
    doc.write_text(
        "```bash\nareal-npu train r.yaml \\\n  a.b=1   # note\ncat > f <<'EOF'\nareal-npu not-a-command\nEOF\n```\n"
        "```text\nareal-npu train RECIPE\n```\n```bash\nNNODES=2 bash x.sh --dry-run\necho areal-npu\n```\n"
    )
    assert examples(doc) == ["areal-npu train r.yaml a.b=1", "NNODES=2 bash x.sh --dry-run"]
    assert split("NNODES=2 .venv/bin/areal-npu doctor") == ({"NNODES": "2"}, ["areal-npu", "doctor"])


EXAMPLES = all_examples()


@pytest.mark.skipif(
    not JAIL_OK, reason=f"recipes grade in the bwrap jail, which cannot start here: {JAIL_WHY}"
)
@pytest.mark.parametrize("where,command", EXAMPLES, ids=[f"{w}:{i}" for i, (w, _) in enumerate(EXAMPLES)])
def test_every_command_example_runs_through_check_or_help(where, command, capsys, monkeypatch, tmp_path):
    if where in RUN_WHOLE:
        pytest.skip("run whole by tests/test_howtos.py")
    env, words = split(command)
    monkeypatch.chdir(ROOT)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if words[0] == "areal-npu":
        argv = words[1:]
        if argv[0] == "train":
            argv += [] if {"--check", "--dry-run"} & set(argv) else ["--check"]
        else:
            argv.append("--help")
        code, out = run_cli(argv, capsys)
        assert code == 0, f"{where}: {command}\n{out[-3000:]}"
        return
    script = words[1] if words[0] == "bash" else words[0]
    if script in SKIP:
        pytest.skip(f"{script}: {SKIP[script]}")
    args = words[2:] if words[0] == "bash" else words[1:]
    args = args[: args.index("--")] if "--" in args else args
    out = subprocess.run(
        ["bash", script, *args, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.returncode == 0 and "usage" in out.stdout.lower(), f"{where}: {command}\n{out.stderr[-2000:]}"


@pytest.mark.skipif(
    not JAIL_OK, reason=f"recipes grade in the bwrap jail, which cannot start here: {JAIL_WHY}"
)
def test_the_examples_in_help_texts_are_accepted(capsys, monkeypatch):
    """`e.g.` in every subcommand's --help: the recipe path checks with the override examples, the
    benchmark flags are flags of every benchmark script."""
    monkeypatch.chdir(ROOT)
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "train" in a.choices).choices
    texts = {name: sub.format_help() for name, sub in subparsers.items()}
    found = {
        name: re.findall(r"e\.g\.\s+(\S+(?:\s+--?\S+)*)", " ".join(text.split()))
        for name, text in texts.items()
    }
    recipes = [e for e in found["train"] if e.endswith(".yaml")]
    overrides = [e for e in found["train"] if "=" in e]
    assert recipes and overrides, found["train"]
    for recipe in recipes:
        code, out = run_cli(["train", recipe, *overrides, "--check"], capsys)
        assert code == 0, out[-2000:]
    flags = [f for e in found.get("bench", []) for f in e.split() if f.startswith("--")]
    for script in sorted((ROOT / "scripts").glob("bench_*.py")):
        for flag in flags:
            assert f'"{flag}"' in script.read_text(), f"{script.name} has no {flag}"


def test_readme_opens_with_the_two_commands_and_stays_a_guide():
    text = (ROOT / "README.md").read_text()
    first_block = text[text.index("```bash\n") + 8 : text.index("```\n", text.index("```bash\n") + 8)]
    assert text.startswith("# areal-npu\n\n```bash\n")
    assert [line.split("#")[0].strip() for line in first_block.splitlines()] == [
        "bash scripts/quickstart.sh",
        "bash scripts/test.sh",
    ]
    assert len(text.encode()) < 12 * 1024, "README.md is a guide: move evidence to docs/STATUS.md"


def test_relative_links_in_the_guides_resolve():
    pages = [
        ROOT / "README.md",
        ROOT / "docker" / "README.md",
        ROOT / "docs" / "STATUS.md",
        ROOT / "docs" / "LAYOUT.md",
    ]
    pages += sorted((ROOT / "docs" / "howto").glob("*.md"))
    for page in pages:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), (
                f"{page.relative_to(ROOT)} links {target}, which is not there"
            )
