"""The chat template as token pieces for a growing multi-turn episode (token in, token out).

An episode is one token sequence: the prompt (system + task message + the template's generation
prompt), then model turns as the engine returned them, each followed by the environment's
observation turn. The model's tokens are never re-tokenised; an observation turn is rendered
through the tokenizer's own chat template and tokenised once, as the *text between* the model's
turn and the next generation: what closes the assistant turn (``<|im_end|>\\n`` for ChatML; its
first token is dropped when the model already ended the turn with it), the observation message,
and the next generation prompt.

That text is taken from a probe conversation ``[user, assistant(<sentinel>), observation]`` as
everything after the sentinel, so it is right for templates that render an assistant message
differently once it is no longer the last one (Qwen3's templates drop the ``<think>`` part then):
only what comes *after* the assistant's content is used. A tokenizer without a chat template gets
ChatML when it has the ``<|im_start|>``/``<|im_end|>`` tokens (the tiny byte tokenizer does); with
``tools`` (the gateway's tool-call mode) such a tokenizer gets :data:`QWEN_TOOLS_TEMPLATE`, ChatML with
tools written the way Qwen3.5/3.6's template writes them (vLLM's ``qwen3_coder`` parser reads them back).
"""

from __future__ import annotations

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3.5's tool format, shortened: the tools as JSON in the system turn, an assistant's calls as
# <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call> after its text,
# consecutive tool results as <tool_response> blocks in one user turn. A newline right after a tag is
# written as an expression: transformers' jinja trims it otherwise (trim_blocks)
QWEN_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n\nYou have access to the following functions:\n\n<tools>{% for tool in tools %}"
    "{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\nIf you choose to call a function ONLY reply "
    "in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' and loop.first and tools %}"
    "{% elif m['role'] == 'tool' %}{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% for call in m.get('tool_calls') or [] %}"
    "{% set f = call['function'] %}{% if not loop.first %}{{ '\\n' }}{% elif m['content'] | trim %}{{ '\\n\\n' }}"
    "{% endif %}<tool_call>\n<function={{ f['name'] }}>\n{% for k, v in f['arguments'].items() %}"
    "<parameter={{ k }}>\n{{ v | tojson if v is mapping or (v is sequence and v is not string) else v }}"
    "\n</parameter>\n{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SENTINEL = "<<areal-npu assistant turn 5d1c>>"
_SLOT = "<<areal-npu content {} 5d1c>>"
# whose message contents are tokenised as plain text (what a command printed, a harness's messages):
# a special token spelled in them (``<|im_start|>``) must not become one
PLAIN_ROLES = frozenset({"user", "tool", "system"})


class ChatFormat:
    def __init__(self, tokenizer, observation_role: str = "user"):
        self.tokenizer = tokenizer
        self.observation_role = observation_role
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            vocab = tokenizer.get_vocab()
            if "<|im_start|>" not in vocab or "<|im_end|>" not in vocab:
                raise ValueError(
                    "the tokenizer has no chat template and no <|im_start|>/<|im_end|> tokens for ChatML"
                )
            template, self.tools_template = CHATML_TEMPLATE, QWEN_TOOLS_TEMPLATE
        else:
            self.tools_template = template
        self.template = template
        probe = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}])
        close = probe[probe.index(_SENTINEL) + len(_SENTINEL) :]
        special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        close_ids = self.encode(close)
        # The token that ends an assistant turn (<|im_end|>): the engines stop on it.
        self.end_of_turn_id = close_ids[0] if close_ids and close_ids[0] in special else None
        self.end_of_turn_text = (
            tokenizer.decode([self.end_of_turn_id]) if self.end_of_turn_id is not None else ""
        )
        if self.end_of_turn_text and not close.startswith(self.end_of_turn_text):
            self.end_of_turn_id, self.end_of_turn_text = None, ""
        self.stop_ids = sorted({i for i in (self.end_of_turn_id, tokenizer.eos_token_id) if i is not None})

    def render(
        self, messages: list[dict], add_generation_prompt: bool = False, tools: list | None = None
    ) -> str:
        """The template's text; ``tools`` (OpenAI function specs) as the template renders them."""
        if tools:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      chat_template=self.tools_template)  # fmt: skip
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=self.template
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def encode_plain(self, text: str) -> list[int]:
        """``text`` as plain text: special-token spellings in it are split into ordinary tokens."""
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []

    def encode_with_contents(self, text: str, contents: list[str]) -> list[int]:
        """``text`` (rendered with :data:`_SLOT` placeholders) with the template's frame encoded as it is
        and each slot's content as plain text."""
        ids, rest = [], text
        for i, content in enumerate(contents):
            before, found, rest = rest.partition(_SLOT.format(i))
            if not found:
                raise ValueError("the chat template changed a message's content while rendering it; its "
                                 "special-token spellings cannot be kept plain")  # fmt: skip
            ids += self.encode(before) + self.encode_plain(content)
        return ids + self.encode(rest)

    def _slotted(self, messages: list[dict]) -> tuple[list[dict], list[str]]:
        out, contents = [], []
        for m in messages:
            if m["role"] in PLAIN_ROLES:
                out.append({**m, "content": _SLOT.format(len(contents))})
                contents.append(m["content"])
            else:
                out.append(m)
        return out, contents

    def messages_ids(self, messages: list[dict], tools: list | None = None) -> list[int]:
        """A whole conversation and the generation prompt as ids (user / tool / system contents plain)."""
        slotted, contents = self._slotted(messages)
        return self.encode_with_contents(self.render(slotted, True, tools), contents)

    def continuation_ids(
        self, messages: list[dict], model_ended_turn: bool, tools: list | None = None
    ) -> list[int]:
        """:meth:`continuation_text` as ids (user / tool contents plain)."""
        slotted, contents = self._slotted(messages)
        return self.encode_with_contents(self.continuation_text(slotted, model_ended_turn, tools), contents)

    def prompt_text(self, system: str, user: str) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        return self.render(messages, add_generation_prompt=True)

    def observation_text(self, content: str, model_ended_turn: bool) -> str:
        """The text between a model turn and the next generation: the turn's close, the observation
        message with ``content``, the generation prompt. ``model_ended_turn``: the model's last token
        was :attr:`end_of_turn_id` (then the close does not repeat it)."""
        return self.continuation_text([{"role": self.observation_role, "content": content}], model_ended_turn)

    def continuation_text(
        self, messages: list[dict], model_ended_turn: bool, tools: list | None = None
    ) -> str:
        """The text between a model turn and the next generation when ``messages`` (user / tool turns)
        follow it: the turn's close, those messages as the template renders them after an assistant
        turn, the generation prompt. (What a template writes after an assistant's text -- its tool
        calls -- the model sampled: the probe has none, and only the turn's close is kept of it.)"""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}, *messages]
        text = self.render(probe, True, tools)
        text = text[text.index(_SENTINEL) + len(_SENTINEL) :]  # the first one: the assistant's
        if model_ended_turn and self.end_of_turn_text and text.startswith(self.end_of_turn_text):
            text = text[len(self.end_of_turn_text) :]
        return text
