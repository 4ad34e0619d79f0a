"""``areal_npu/names.py`` owns every metric key and shared name prefix.

The scan reads the source of the package, of ``kernels/`` (installed as ``areal_npu.kernels``) and of
``scripts/`` (benchmarks read the engines' stats by key) -- ``ast``: string constants and the
constant head of every f-string -- and fails on a metric-key literal -- ``<group>/<name>`` or a
``<group>/`` prefix of a metric group -- or on the checkpoint prefix ``"mtp."`` anywhere outside
``areal_npu/names.py``, naming file:line. A producer and a reader that spell a key twice drift
apart silently (a renamed key just stops showing up in ``metrics.jsonl``); one constant makes the
rename a single edit.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from areal_npu import names

ROOT = Path(names.__file__).resolve().parents[1]
#: Where a key may be spelled: everything that is installed or run beside the package. Tests are left
#: out: they spell keys on purpose, as the independent reference of what metrics.jsonl holds.
SCANNED = ("areal_npu", "kernels", "scripts")
OWNER = "areal_npu/names.py"

#: The groups of metric keys. Fixed here as well as derived from names.py, so a key of a group that
#: names.py does not know yet is still caught.
METRIC_GROUPS = {
    "eval", "episode", "grpo", "mem", "mtp", "packing", "perf", "ppo", "reward", "rollout", "sft",
    "staleness", "timing", "train",
}  # fmt: skip

#: Files allowed to spell keys of a group themselves, and why.
EXEMPT = {
    # platform sits beside names (neither imports the other); its memory_stats feed `areal-npu doctor`'s
    # report, not metrics.jsonl.
    "areal_npu/platform.py": {"mem"},
}

_KEY = re.compile(r"^([a-z][a-z0-9_]*)/[A-Za-z0-9_/]*$")


def _groups() -> set[str]:
    derived = set()
    for value in vars(names).values():
        for text in value if isinstance(value, tuple) else (value,):
            if isinstance(text, str) and (m := _KEY.match(text)):
                derived.add(m.group(1))
    return METRIC_GROUPS | derived


def _literals(tree: ast.AST):
    """(line, text) of every string constant and f-string head, each once."""
    heads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            heads.add(id(node.values[0]))
            yield node.lineno, node.values[0].value
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in heads:
            yield node.lineno, node.value


def offending_literals(root: Path = ROOT) -> list[str]:
    """``path:line: 'text'`` of every metric-key literal or ``"mtp."`` prefix outside names.py."""
    groups = _groups()
    found = []
    for path in sorted(p for folder in SCANNED for p in (root / folder).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == OWNER:
            continue
        exempt = EXEMPT.get(rel, set())
        for line, text in sorted(_literals(ast.parse(path.read_text(), str(path))), key=lambda lt: lt[0]):
            m = _KEY.match(text)
            if (m is not None and m.group(1) in groups - exempt) or text == names.MTP_PREFIX:
                found.append(f"{rel}:{line}: {text!r}")
    return found


def test_no_metric_key_literal_outside_names():
    found = offending_literals()
    assert not found, "metric keys / shared prefixes spelled outside areal_npu/names.py:\n" + "\n".join(found)


def test_the_scan_sees_keys_prefixes_and_fstring_heads(tmp_path):
    for folder in SCANNED:
        (tmp_path / folder).mkdir()
    (tmp_path / "areal_npu" / "names.py").write_text('KEY = "train/lr"\n')  # the owner itself is exempt
    (tmp_path / "areal_npu" / "producer.py").write_text(
        'stats = {"train/grad_norm": 1.0, "ppo/loss": 0.0}\n'
        'key = f"mtp/loss_d{3}"\n'
        'is_mtp = "x".startswith("mtp/")\n'
        'head = "mtp." + "fc.weight"\n'
        'path = "runs/x"  # not a metric group\n'
        '"""A docstring naming train/lr in prose."""\n'
    )
    # outside the package directory: the installed kernels and the benchmark scripts (the scan once
    # walked areal_npu/ only, and scripts/bench_engines.py spelled ppo/loss, train/grad_norm, mtp/loss)
    (tmp_path / "kernels" / "k.py").write_text('N = "packing/truncated_sequences"\n')
    (tmp_path / "scripts" / "bench.py").write_text('keys = ("ppo/n_valid_tokens", "train/n_tokens")\n')
    (tmp_path / "scripts" / "names.py").write_text('V = "train/version"\n')  # only areal_npu's owns keys
    found = offending_literals(tmp_path)
    assert [f.split(":", 2) for f in found] == [
        ["areal_npu/producer.py", "1", " 'train/grad_norm'"],
        ["areal_npu/producer.py", "1", " 'ppo/loss'"],
        ["areal_npu/producer.py", "2", " 'mtp/loss_d'"],
        ["areal_npu/producer.py", "3", " 'mtp/'"],
        ["areal_npu/producer.py", "4", " 'mtp.'"],
        ["kernels/k.py", "1", " 'packing/truncated_sequences'"],
        ["scripts/bench.py", "1", " 'ppo/n_valid_tokens'"],
        ["scripts/bench.py", "1", " 'train/n_tokens'"],
        ["scripts/names.py", "1", " 'train/version'"],
    ]


def test_every_key_constant_is_unique():
    """Two constants spelling one key would be two owners of it."""
    keys = [(n, v) for n, v in vars(names).items() if n.isupper() and isinstance(v, str) and _KEY.match(v)]
    seen: dict[str, str] = {}
    for name, value in keys:
        assert value not in seen, f"{name} and {seen[value]} both spell {value!r}"
        seen[value] = name
