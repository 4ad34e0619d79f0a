"""Action parsing and the chat-template pieces of the shell agent, against hand-written text."""

import pytest

from areal_npu.agent.actions import SUBMIT_MARKER, cut_middle, is_submission, parse_action
from areal_npu.agent.chat_format import ChatFormat
from areal_npu.model.tiny import build_tokenizer

# Qwen3's template in short: a tool message becomes a user turn with <tool_response>, the generation
# prompt carries an empty think block, and an assistant message is rendered with a think block only
# while no user query follows it (so earlier turns render differently than when they were last).
QWEN3_LIKE = """{%- set ns = namespace(last_query_index=messages|length - 1, multi_step_tool=true) %}
{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == "user" %}{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == "user" or message.role == "system" %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{%- if loop.index0 > ns.last_query_index %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content }}
{%- else %}{{- '<|im_start|>assistant\\n' + message.content }}{%- endif %}{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"""


@pytest.fixture()
def tok():
    return build_tokenizer()


def test_chatml_fallback_pieces(tok):
    chat = ChatFormat(tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.end_of_turn_id == im_end and set(chat.stop_ids) == {im_end, tok.eos_token_id}
    assert (
        chat.prompt_text("S", "U")
        == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        chat.observation_text("O", model_ended_turn=True)
        == "\n<|im_start|>user\nO<|im_end|>\n<|im_start|>assistant\n"
    )
    assert chat.observation_text("O", model_ended_turn=False) == (
        "<|im_end|>\n<|im_start|>user\nO<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_qwen3_style_template_with_tool_observations(tok):
    tok.chat_template = QWEN3_LIKE
    chat = ChatFormat(tok, observation_role="tool")
    assert chat.end_of_turn_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.observation_text("ls: x", model_ended_turn=True) == (
        "\n<|im_start|>user\n<tool_response>\nls: x\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert (
        chat.prompt_text("", "U")
        == "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_a_tokenizer_without_template_or_chatml_tokens_is_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, merges=[])
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bare = PreTrainedTokenizerFast(tokenizer_object=backend)
    with pytest.raises(ValueError, match="no chat template"):
        ChatFormat(bare)


@pytest.mark.parametrize(
    ("text", "command", "blocks"),
    [
        ("think\n```bash\nls -la\n```\n", "ls -la", 1),
        ("```bash\ncat <<'EOF' > a.py\nx = 1\nEOF\n```", "cat <<'EOF' > a.py\nx = 1\nEOF", 1),
        ("no command", None, 0),
        ("```python\nprint(1)\n```", None, 0),
        ("```bash\nls\n```\n```bash\npwd\n```", None, 2),
        ("```bash\n   \n```", None, 1),
        ("```bash\nls", None, 0),  # cut before the closing fence
        ("<think>maybe\n```bash\nrm -r x\n```\n</think>\nSo:\n```bash\nls\n```", "ls", 1),
        ("<think>only thinking\n```bash\nls\n```\n</think>\nno command", None, 0),
    ],
)
def test_parse_action(text, command, blocks):
    action = parse_action(text)
    assert (action.command, action.blocks) == (command, blocks)


def test_submission_and_cutting():
    assert is_submission(f"\n{SUBMIT_MARKER}\nrest")
    assert not is_submission(f"tests ok\n{SUBMIT_MARKER}\n") and not is_submission("")
    text = "a" * 600 + "b" * 600
    cut, was_cut = cut_middle(text, 300)
    assert was_cut and cut.startswith("a" * 150 + "\n[... 900 characters") and cut.endswith("]\n" + "b" * 150)
    assert cut_middle("short", 300) == ("short", False)
