"""Tool-call mode of the gateway (:mod:`areal_npu.agent.gateway`): a request's ``tools`` are rendered
into the prompt by the model's chat template, and the sampled text is read back into OpenAI
``tool_calls`` by vLLM's own tool parser (``--tool-call-parser``'s registry, ``vllm.tool_parsers``),
chosen by ``workflow.shell.tool_parser``; ``qwen3_coder`` is the one vLLM's recipes give Qwen3.5/3.6.

Messages are compared and rendered in one normal form: an assistant's ``tool_calls`` as
``{"type": "function", "function": {"name", "arguments": dict}}`` (arguments parsed from their JSON
string, as vLLM hands them to templates; call ids left out: templates of the Qwen family do not
render them), a tool message's ``tool_call_id`` kept.
"""

from __future__ import annotations

import json
import secrets

DEFAULT_PARSER = "qwen3_coder"


def parser_names() -> list[str]:
    """The tool parsers vLLM registers (imports vLLM)."""
    from vllm.tool_parsers import ToolParserManager

    return ToolParserManager.list_registered()


def normalize_tools(tools) -> list[dict]:
    """A request's ``tools``: OpenAI function specs (``{"type": "function", "function": {"name", ...}}``)."""
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise ValueError(
                'every tool must be {"type": "function", "function": {"name": ..., "parameters": ...}}'
            )
    return tools


def normalize_call(call) -> dict:
    """One assistant tool call in the normal form (arguments a dict)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("a tool call needs function.name")
    args = fn.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tool call arguments are not JSON: {exc}") from None
    if not isinstance(args, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


class ToolCallParser:
    """vLLM's tool parser ``name`` over the model's tokenizer; :meth:`parse` reads one reply."""

    def __init__(self, name: str, tokenizer):
        try:
            from vllm.tool_parsers import ToolParserManager
        except ImportError as exc:
            raise ValueError(f"tool calls need vLLM's tool parsers (the cpu extra here): {exc}") from None
        try:
            self.cls = ToolParserManager.get_tool_parser(name)
        except KeyError:
            raise ValueError(f"unknown tool parser {name!r}; vLLM has {', '.join(parser_names())}") from None
        self.tokenizer = tokenizer

    def parse(self, text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
        """``(content, tool_calls)`` of a reply as vLLM's chat-completions server would return them
        (``tool_calls`` in the OpenAI wire form, arguments a JSON string; ``[]`` when none)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="areal-npu-policy", messages=[], tools=tools)
        parser = self.cls(self.tokenizer, request.tools)  # a parser keeps per-reply state: one per reply
        info = parser.extract_tool_calls(text, request)
        if not info.tools_called:
            return text, []
        calls = [{"id": tc.id or f"call_{secrets.token_hex(8)}", "type": "function",
                  "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                 for tc in info.tool_calls]  # fmt: skip
        return info.content or None, calls
