"""What the shell agent says and hears, as text: the action in a model turn, the observation after it.

The conventions are mini-SWE-agent's (the de-facto open design for shell agents):

- a model turn is free text with **exactly one** fenced ```` ```bash ```` block (after the
  thinking, for a reasoning model's ``<think>...</think>``); its content is the command. Zero blocks, two or more, or an empty one is a format error, answered with
  :data:`FORMAT_ERROR` as the observation (the episode goes on);
- the command runs with ``/bin/sh -c`` in the repository; the observation is its exit code and its
  output (stdout and stderr together), the output cut to its head and tail with a note when longer
  than ``max_chars``;
- the agent submits by running ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``: when the first
  non-blank line of a command's output is :data:`SUBMIT_MARKER` the episode ends (the command runs
  like any other, so ``python -m unittest && echo COMPLETE_...`` submits only when the tests pass).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# mini-SWE-agent's pattern: the command is between "```bash" + newline and a newline + "```".
_BASH_BLOCK = re.compile(r"```bash\s*\n(.*?)\n```", re.DOTALL)

SYSTEM_PROMPT = f"""You are a software engineer fixing an issue in the repository in your current directory (/repo).
Every reply has two parts: a few lines of reasoning, then exactly one shell command in a fenced block:

```bash
<command>
```

The command runs with /bin/sh in /repo and its exit code and output come back in the next message.
Only Python 3 and standard shell tools are installed; there is no network. Files you change persist
between commands; processes do not. When the fix is done, reply with the command
`echo {SUBMIT_MARKER}` on its own; after that you cannot continue."""

TASK_PROMPT = "<issue>\n{problem}\n</issue>\n\nFix the issue in /repo. Hidden tests will check your fix."

FORMAT_ERROR = (
    "Format error: your reply must contain exactly one ```bash block with one command; it had {found}.\n"
    "Reply with a few lines of reasoning and then one ```bash block. "
    f"To submit, run `echo {SUBMIT_MARKER}`."
)

OBSERVATION = "<returncode>{code}</returncode>\n<output>\n{output}</output>"


@dataclass(frozen=True)
class Action:
    command: str | None  # None: a format error
    blocks: int  # how many ```bash blocks the turn had


def parse_action(text: str) -> Action:
    """The command of a model turn, or a format error when it has no, several, or an empty block.
    A reasoning model's thinking (everything up to the last ``</think>``) is not searched: commands
    it drafts there are not the answer."""
    blocks = _BASH_BLOCK.findall(text.rpartition("</think>")[2])
    if len(blocks) != 1 or not blocks[0].strip():
        return Action(None, len(blocks))
    return Action(blocks[0].strip(), 1)


def format_error(action: Action) -> str:
    found = "an empty block" if action.blocks == 1 else f"{action.blocks} blocks"
    return FORMAT_ERROR.format(found=found)


def is_submission(output: str) -> bool:
    lines = output.lstrip().splitlines()
    return bool(lines) and lines[0].strip() == SUBMIT_MARKER


def cut_middle(text: str, max_chars: int) -> tuple[str, bool]:
    """``text`` with its middle replaced by a note when longer than ``max_chars`` (head and tail kept,
    ``max_chars`` characters of them together); ``(text, whether it was cut)``."""
    if len(text) <= max_chars:
        return text, False
    head = max_chars // 2
    tail = max_chars - head
    omitted = len(text) - max_chars
    note = (
        f"\n[... {omitted} characters of output omitted; use head, tail, grep or sed -n to see parts ...]\n"
    )
    return text[:head] + note + (text[-tail:] if tail else ""), True
