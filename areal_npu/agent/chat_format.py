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
ChatML when it has the ``<|im_start|>``/``<|im_end|>`` tokens (the tiny byte tokenizer does).
"""

from __future__ import annotations

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SENTINEL = "<<areal-npu assistant turn 5d1c>>"


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
            template = CHATML_TEMPLATE
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

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=self.template
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def prompt_text(self, system: str, user: str) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        return self.render(messages, add_generation_prompt=True)

    def observation_text(self, content: str, model_ended_turn: bool) -> str:
        """The text between a model turn and the next generation: the turn's close, the observation
        message with ``content``, the generation prompt. ``model_ended_turn``: the model's last token
        was :attr:`end_of_turn_id` (then the close does not repeat it)."""
        messages = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": _SENTINEL},
            {"role": self.observation_role, "content": content},
        ]
        text = self.render(messages, add_generation_prompt=True)
        text = text[text.index(_SENTINEL) + len(_SENTINEL) :]  # the first one: the assistant's
        if model_ended_turn and self.end_of_turn_text and text.startswith(self.end_of_turn_text):
            text = text[len(self.end_of_turn_text) :]
        return text
