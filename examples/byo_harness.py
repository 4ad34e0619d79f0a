"""A harness of your own in the RL loop: anything that speaks OpenAI chat.

    workflow.shell.harness: byo_harness:run     # this file importable as byo_harness (PYTHONPATH)

areal-npu calls ``run(ctx)`` in a thread per episode. ``ctx.base_url`` / ``ctx.api_key`` are the
episode's OpenAI-compatible endpoint (the gateway records every token the model samples: that is what
is trained), ``ctx.execute(command)`` runs a shell command in the task's environment and returns
``(output, exit code)``. Return how the episode ended; the reward is the task's hidden tests on the
repository as you leave it. Here: one fenced ```bash block a turn, ``echo DONE`` submits.
"""

import re

from openai import OpenAI

BLOCK = re.compile(r"```bash\n(.*?)\n```", re.S)


def run(ctx) -> dict:
    client = OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    messages = [
        {"role": "system", "content": "Fix the bug. Reply with one ```bash block a turn; `echo DONE` when done."},
        {"role": "user", "content": ctx.problem_statement},
    ]
    errors = 0
    for _ in range(ctx.max_turns):
        reply = client.chat.completions.create(model=ctx.model, messages=messages).choices[0].message.content
        messages.append({"role": "assistant", "content": reply})
        commands = BLOCK.findall(reply)
        if len(commands) != 1:
            errors += 1
            messages.append({"role": "user", "content": "Reply with exactly one ```bash block."})
            continue
        if commands[0].strip() == "echo DONE":
            return {"exit_status": "Submitted", "format_errors": errors}
        output, code = ctx.execute(commands[0])
        messages.append({"role": "user", "content": f"exit code {code}\n{output}"})
    return {"exit_status": "LimitsExceeded", "format_errors": errors}
