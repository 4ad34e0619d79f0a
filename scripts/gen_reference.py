"""Generate the option and command references under ``docs/reference/``.

    python scripts/gen_reference.py           # (re)write config.md, config.zh.md, cli.md
    python scripts/gen_reference.py --check   # exit 1 if any of them is stale or incomplete
    python scripts/gen_reference.py --zh-todo # the zh.json entries that are missing or stale

``config.md`` / ``config.zh.md``: every option of a recipe, found by walking the config tree from the
root recipe dataclass (``areal_npu.recipe.RLConfig``) through its dataclass-valued fields, so a config
class may live in any module. Defaults come from a default-constructed root (so a parent's
``default_factory`` shows what a recipe really starts from); a dataclass-valued field gets its own
table, and so does a ``dict`` field whose keys are a dataclass's fields (``DICT_SCHEMAS``).
``cli.md``: every subcommand of ``areal_npu.cli.build_parser()`` and its arguments.

An option's help text, first match wins: (1) the comments in the body of the dataclass that declares
the field -- the full-line ``#`` block directly above it, then its trailing ``# comment``, joined
(``ast`` + ``tokenize`` over ``inspect.getsource``, in ``scripts/_reference_source.py``; pragmas
like ``# noqa`` dropped); (2) an entry ``name: text`` (or ``a, b: text``) in that class's docstring;
(3) for a dataclass-valued field, the first paragraph of that dataclass's docstring; (4)
``docs/reference/help.json`` (dotted key -> text) for fields the source leaves undocumented. An
entry there for a key the source documents or that does not exist is an error, so the table shrinks
as comments are written.

Chinese: ``docs/reference/zh.json``, dotted key -> ``{"en": ..., "zh": ...}`` where ``en`` is the
English text the translation was made from. A missing entry, or one whose ``en`` differs from the
current English, is marked in ``config.zh.md`` and fails this script and ``tests/test_reference_docs.py``
(naming the key), so translations cannot rot silently. Technical terms and values stay in English.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REF_DIR = ROOT / "docs" / "reference"
HELP_TABLE = REF_DIR / "help.json"
ZH_TABLE = REF_DIR / "zh.json"
REGENERATE = "python scripts/gen_reference.py"


def _root_config() -> type:
    from areal_npu.recipe import RLConfig

    return RLConfig


def _adapt_schema(spec: Any) -> type:
    """``rollout.spec.adapt``: the adaptive policy's own config, as ``SpecConfig.validate`` resolves it."""
    from areal_npu.speculation.config import resolve_adapt

    return type(resolve_adapt({}, k_max=2))


#: dict-valued options whose keys are a dataclass's fields: dotted key -> (parent config -> that
#: dataclass, field names not settable through the dict).
DICT_SCHEMAS: dict[str, tuple[Callable[[Any], type], frozenset[str]]] = {
    "rollout.spec.adapt": (_adapt_schema, frozenset({"k_max"})),  # k_max is num_speculative_tokens
}

MISSING_EN = "⚠ NO HELP TEXT: add a comment to the field or an entry to docs/reference/help.json"
MISSING_ZH = "⚠ 缺少译文 (untranslated; add it to docs/reference/zh.json)"
STALE_ZH = "⚠ 译文过期 (stale translation; the English text changed, update docs/reference/zh.json)"


# --- help text from the source (scripts/_reference_source.py) ---------------------------------------


def _load_sibling(name: str):
    """A module next to this script, by path: the script also runs loaded by path (the tests), when
    ``scripts/`` is not on ``sys.path``."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


_source = _load_sibling("_reference_source")
source_help = _source.source_help
class_summary = _source.class_summary
_declaring_class = _source.declaring_class


# --- the option tree --------------------------------------------------------------------------------


@dataclass
class Option:
    key: str  # dotted path
    type: str
    default: Any
    help_source: str  # text from the source ("" if none)
    section: str | None = None  # dotted key of the nested table this option opens, if any


@dataclass
class Section:
    key: str  # "" for the root
    cls: type
    options: list[Option] = field(default_factory=list)


def _type_name(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def walk(root: Any | None = None) -> list[Section]:
    """Every config table, root first, in field order (pre-order)."""
    root = _root_config()() if root is None else root
    sections: list[Section] = []

    def visit(obj: Any, prefix: str, cls: type, skip: frozenset[str] = frozenset()) -> None:
        section = Section(prefix.rstrip("."), cls)
        sections.append(section)
        children: list[tuple[Any, str, type, frozenset[str]]] = []
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            key = prefix + f.name
            value = getattr(obj, f.name)
            text = source_help(_declaring_class(cls, f.name)).get(f.name, "")
            opt = Option(key, _type_name(f.type), value, text)
            if dataclasses.is_dataclass(value):
                opt.default = None
                opt.help_source = text or class_summary(type(value))
                opt.section = key
                children.append((value, key + ".", type(value), frozenset()))
            elif key in DICT_SCHEMAS:
                schema, hidden = DICT_SCHEMAS[key]
                sub = schema(obj)
                opt.section = key
                children.append((sub(), key + ".", sub, hidden))
            section.options.append(opt)
        for child in children:
            visit(*child)

    visit(root, "", type(root))
    return sections


def options(sections: list[Section] | None = None) -> list[Option]:
    return [o for s in (sections or walk()) for o in s.options]


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


@dataclass
class Texts:
    """The help text of every option, English and Chinese, and what is wrong with the tables."""

    en: dict[str, str]
    zh: dict[str, str]
    missing_help: list[str]
    missing_zh: list[str]
    stale_zh: list[str]
    table_errors: list[str]

    @property
    def problems(self) -> list[str]:
        lists = (("options without help text (comment the field, or add to docs/reference/help.json)", self.missing_help),
                 ("options without a Chinese translation in docs/reference/zh.json", self.missing_zh),
                 ("Chinese translations made from an older English text (update 'en' and 'zh' in "
                  "docs/reference/zh.json; --zh-todo lists them)", self.stale_zh))  # fmt: skip
        return self.table_errors + [f"{what}: {', '.join(keys)}" for what, keys in lists if keys]


def texts(opts: list[Option], help_table: dict | None = None, zh_table: dict | None = None) -> Texts:
    help_table = _load(HELP_TABLE) if help_table is None else help_table
    zh_table = _load(ZH_TABLE) if zh_table is None else zh_table
    keys = {o.key for o in opts}
    errors = [f"docs/reference/help.json: {k!r} is not an option" for k in sorted(set(help_table) - keys)]
    errors += [f"docs/reference/zh.json: {k!r} is not an option" for k in sorted(set(zh_table) - keys)]
    en: dict[str, str] = {}
    zh: dict[str, str] = {}
    missing_help, missing_zh, stale_zh = [], [], []
    for o in opts:
        if o.help_source and o.key in help_table:
            errors.append(
                f"docs/reference/help.json: {o.key!r} is documented in the source now; remove the entry"
            )
        text = o.help_source or help_table.get(o.key, "").strip()
        if not text:
            missing_help.append(o.key)
        en[o.key] = text
        entry = zh_table.get(o.key)
        if not entry or not str(entry.get("zh", "")).strip():
            missing_zh.append(o.key)
        elif entry.get("en") != text:
            stale_zh.append(o.key)
        zh[o.key] = entry["zh"].strip() if entry and entry.get("zh") else ""
    return Texts(en, zh, missing_help, missing_zh, stale_zh, errors)


# --- markdown ---------------------------------------------------------------------------------------

HEADER = (
    "<!-- Generated by scripts/gen_reference.py from {what}; do not edit by hand. "
    "Regenerate: python scripts/gen_reference.py -->\n"
)


def _inline(text: str) -> str:
    """Docstring markup to Markdown, safe inside a table cell."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)  # :func:`x` -> `x`
    text = text.replace("``", "`")
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # outside code spans
        parts[i] = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", parts[i].replace("*", r"\*"))  # not an HTML tag
    return "`".join(parts).replace("|", r"\|").replace("\n", " ")


def yamlish(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _anchor(key: str) -> str:
    """GitHub's heading slug for a heading whose text is ``key`` in backticks."""
    return re.sub(r"[^\w\- ]", "", key.lower()).replace(" ", "-")


#: the words of each language's page; {n}, {tables}, {root} are filled in.
PAGE = {
    "en": {
        "from": "the config dataclasses",
        "title": "# Configuration reference\n",
        "intro": "Every option of a recipe ({n} options in {tables} tables), read from the config dataclasses "
        "under the root `{root}`. A recipe YAML sets them as nested mappings; `areal-npu train RECIPE "
        "a.b.c=value` overrides them on the command line. Defaults are those of a recipe that does not set the "
        "key (YAML/JSON notation). Unknown keys, wrong types and impossible combinations are refused before "
        "any work starts (exit code 2).\n\n中文版: [config.zh.md](config.zh.md). Command line: [cli.md](cli.md).\n",
        "head": "| key | type | default | description |",
        "top": "top level", "defined": "Defined by {where}.\n", "table": "table", "keys": "keys",
    },
    "zh": {
        "from": "the config dataclasses and docs/reference/zh.json",
        "title": "# 配置参考\n",
        "intro": "配方（recipe）的全部选项（{n} 个选项，{tables} 张表），由根配置 `{root}` 下的配置 dataclass "
        "生成。配方 YAML 以嵌套映射设置它们；`areal-npu train RECIPE a.b.c=value` 在命令行上覆盖。默认值即配方"
        "未设置该键时的取值（YAML/JSON 写法）。未知的键、错误的类型和不可能的组合都会在任何工作开始前被拒绝"
        "（退出码 2）。\n\nEnglish: [config.md](config.md). 命令行：[cli.md](cli.md)。\n",
        "head": "| 键 | 类型 | 默认值 | 说明 |",
        "top": "顶层", "defined": "定义于 {where}。\n", "table": "见表", "keys": "键",
    },
}  # fmt: skip


def _help_cell(key: str, tx: Texts, lang: str) -> str:
    if lang == "en":
        return _inline(tx.en[key]) if tx.en[key] else MISSING_EN
    if key in tx.missing_zh:
        return f"{MISSING_ZH} {_inline(tx.en[key])}"
    return f"{STALE_ZH} {_inline(tx.zh[key])}" if key in tx.stale_zh else _inline(tx.zh[key])


def render_config(sections: list[Section], tx: Texts, lang: str) -> str:
    words = PAGE[lang]
    n = sum(1 for s in sections for o in s.options if o.section is None)

    def title(key: str) -> str:
        return f"`{key}`" if key else words["top"]

    out = [HEADER.format(what=words["from"]), words["title"],
           words["intro"].format(n=n, tables=len(sections), root=sections[0].cls.__qualname__),
           " · ".join(f"[{title(s.key)}](#{_anchor(title(s.key))})" for s in sections) + "\n"]  # fmt: skip
    for s in sections:
        where = f"`{s.cls.__module__}.{s.cls.__qualname__}`"
        out += [
            f"## {title(s.key)}\n",
            words["defined"].format(where=where),
            words["head"] + "\n|---|---|---|---|",
        ]
        for o in s.options:
            default = f"`{yamlish(o.default)}`"
            if o.section:
                link = f"[{words['table']}](#{_anchor(title(o.section))})"
                default = link if o.default is None else f"{default}, {words['keys']}: {link}"
            out.append(f"| `{o.key}` | `{_inline(o.type)}` | {default} | {_help_cell(o.key, tx, lang)} |")
        out.append("")
    return "\n".join(out)


_NARGS = {
    "*": "zero or more",
    "+": "one or more",
    "?": "optional",
    argparse.REMAINDER: "the rest of the line",
}


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _fixed_width(parser: argparse.ArgumentParser) -> None:
    """Usage lines independent of the terminal the script runs in."""
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100, max_help_position=40)


def _argument_rows(parser: argparse.ArgumentParser) -> list[str]:
    fmt = parser._get_formatter()
    rows = []
    for a in parser._actions:
        if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) or a.help == argparse.SUPPRESS:
            continue
        name = f"`{fmt._format_action_invocation(a) if a.option_strings else (a.metavar or a.dest)}`"
        if not a.option_strings and a.nargs in _NARGS:
            name += f" ({_NARGS[a.nargs]})"
        if a.nargs == 0:
            kind = "flag"
        else:
            kind = getattr(a.type, "__name__", "str") if a.type else "str"
        default = (
            "" if a.default in (None, False, argparse.SUPPRESS) or a.nargs == 0 else f"`{yamlish(a.default)}`"
        )
        help_text = fmt._expand_help(a) if a.help else ""
        rows.append(f"| {name} | {kind} | {default} | {_inline(help_text)} |")
    return rows


def render_cli(parser: argparse.ArgumentParser | None = None) -> str:
    if parser is None:
        from areal_npu.cli import build_parser

        parser = build_parser()
    _fixed_width(parser)
    subs = list(_subparsers(parser))
    out = [
        HEADER.format(what="areal_npu.cli.build_parser()"),
        "# Command-line reference\n",
        _inline(parser.description or parser.prog) + "\n",
        "Recipe options (`train RECIPE a.b.c=value`) are listed in [config.md](config.md).\n",
        "```\n" + parser.format_usage().strip() + "\n```\n",
        "| command | what it does |\n|---|---|",
        *(f"| [`{name}`](#{_anchor(parser.prog + ' ' + name)}) | {_inline(h)} |" for name, h, _ in subs),
        "",
    ]
    for name, help_text, sub in subs:
        _fixed_width(sub)
        out += [f"## `{parser.prog} {name}`\n", _inline(sub.description or help_text) + "\n"]
        out += ["```\n" + sub.format_usage().strip() + "\n```\n"]
        rows = _argument_rows(sub)
        if rows:
            out += ["| argument | type | default | description |\n|---|---|---|---|", *rows]
        out.append("")
    return "\n".join(out)


# --- entry points -----------------------------------------------------------------------------------


@dataclass
class Reference:
    files: dict[Path, str]  # path -> generated text
    problems: list[str]
    n_options: int


def generate() -> Reference:
    """Everything in memory: the three files and what is wrong with the help/translation tables."""
    sections = walk()
    opts = options(sections)
    tx = texts(opts)
    files = {
        REF_DIR / "config.md": render_config(sections, tx, "en"),
        REF_DIR / "config.zh.md": render_config(sections, tx, "zh"),
        REF_DIR / "cli.md": render_cli(),
    }
    return Reference(files, tx.problems, sum(1 for o in opts if o.section is None))


def stale_files(ref: Reference | None = None) -> list[Path]:
    ref = ref or generate()
    return [p for p, text in ref.files.items() if not p.is_file() or p.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is stale or incomplete"
    )
    parser.add_argument("--zh-todo", action="store_true",
                        help="print the zh.json entries to write or update (current English, old translation)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.zh_todo:
        opts = options()
        tx, table = texts(opts), _load(ZH_TABLE)
        todo = {
            k: {"en": tx.en[k], "zh": table.get(k, {}).get("zh", "")} for k in tx.missing_zh + tx.stale_zh
        }
        print(json.dumps(todo, ensure_ascii=False, indent=2))
        return 0
    ref = generate()
    for problem in ref.problems:
        print(f"gen_reference: {problem}", file=sys.stderr)
    if args.check:
        stale = stale_files(ref)
        for path in stale:
            print(f"gen_reference: {path.relative_to(ROOT)} is stale; run {REGENERATE}", file=sys.stderr)
        return 1 if stale or ref.problems else 0
    REF_DIR.mkdir(parents=True, exist_ok=True)
    for path, text in ref.files.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    print(f"{ref.n_options} options")
    return 1 if ref.problems else 0


if __name__ == "__main__":
    sys.exit(main())
