"""An OpenAI-compatible chat-completions gateway in front of the rollout engines: any agent harness
that speaks OpenAI chat (mini-swe-agent through LiteLLM, the openai client, ...) runs inside the RL
loop, and every token it is trained on is the one the engine sampled.

One server per workflow on 127.0.0.1 (``base_url`` ends in ``/v1``); one key per episode
(``Authorization: Bearer <key>``, the harness's ``api_key``). ``POST /v1/chat/completions`` renders the
model's chat template itself and sends token ids to the engines (AReaL's and slime's design, chosen
because the engines here take token ids and return behaviour log-probs and weight versions per token;
the harness never sees a tokenizer). Each call is recorded exactly (:class:`ChatCall`).

Multi-turn, token-exact: when a request's messages are the previous request's, then the assistant reply
this gateway returned, then new user / tool messages, its prompt is the previous tokens verbatim
(prompt + sampled reply) followed by the template's rendering of the new messages (as
:class:`~areal_npu.agent.chat_format.ChatFormat` renders an observation): one growing sequence, the
sampled tokens never re-tokenised (NeMo-RL forces the same prefix from its server side). Anything else
-- history truncated or compacted, a reply left out (mini-swe-agent drops a reply it could not parse),
earlier turns re-rendered -- starts a new *segment* from a fresh rendering of the whole conversation;
segments train as separate samples of one episode with its reward, and the share of calls that start
one is a metric. The harness's sampling parameters and stop strings are ignored: the workflow's
temperature / top-p and the template's end-of-turn token apply, so the behaviour log-probs are those
of what was sampled.

Tool calls (:mod:`areal_npu.agent.tool_calls`): a request's ``tools`` go through the chat template into
the prompt; the reply's text is parsed by vLLM's tool parser into ``tool_calls`` (``finish_reason``
``tool_calls``). The assistant message with those calls and the ``tool`` results that follow continue
the tokens as above: the sampled tool-call text is kept verbatim, the results rendered as plain text.
``tool_choice`` may be ``auto`` or ``none`` (rendered, not parsed); forcing a call is refused (400).

Context: the episode's token budget counts every segment's tokens (a harness that compacts its history
starts a new segment, and the earlier ones still count), a prefix shared with the segment before
counted once (a reply left out does not charge the conversation before it twice). A call whose prompt
leaves no room gets HTTP 400 "maximum context length" (LiteLLM raises ``ContextWindowExceededError``
on it) and the session records the end reason ``context``; ``max_tokens`` of a call is capped by the
workflow's ``max_new_tokens`` and the room. A compaction -- a new segment whose request rewrote earlier
messages into a prompt shorter than the last turn's prompt and reply -- is marked on its call
(``ChatCall.compacted``), apart from other rewrites (a reply left out, a re-rendering).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from areal_npu.agent import tool_calls
from areal_npu.agent.chat_format import ChatFormat

MODEL_NAME = "areal-npu-policy"


@dataclass
class ChatCall:
    """One chat completion as the engine served it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    continues: bool  # the prompt extends the previous call's tokens (False: a new segment starts here)
    spec: dict | None = None
    compacted: bool = False  # a new segment whose request rewrote earlier messages into a shorter prompt


@dataclass
class Segment:
    """A token sequence of one episode: the first call's prompt, then model turns (``mask`` 1) and the
    rendered messages between them (``mask`` 0, log-prob 0, version -1)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)


class ContextExceeded(Exception):
    pass


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise ValueError(f"message content must be a string or a list of parts, not {type(content).__name__}")


def normalize(messages) -> list[dict]:
    """``[{"role", "content"}]`` with text content, an assistant's ``tool_calls`` and a tool message's
    ``tool_call_id`` in :mod:`~areal_npu.agent.tool_calls`' normal form; other fields (LiteLLM's
    ``function_call: None`` ...) dropped."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("every message needs a role")
        msg = {"role": m["role"], "content": _text(m.get("content"))}
        if m["role"] == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [tool_calls.normalize_call(c) for c in m["tool_calls"]]
        if m["role"] == "tool" and m.get("tool_call_id"):
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    return out


def segments(calls: list[ChatCall]) -> list[Segment]:
    """The episode's calls as token sequences (pure: the records decide everything)."""
    out: list[Segment] = []
    for call in calls:
        if not call.continues or not out:
            out.append(Segment(list(call.prompt_ids)))
        else:
            seg = out[-1]
            seen = len(seg.prompt_ids) + len(seg.response_ids)
            if call.prompt_ids[:seen] != seg.prompt_ids + seg.response_ids:
                raise ValueError("a continuing call's prompt does not extend its segment")
            between = call.prompt_ids[seen:]
            seg.response_ids += between
            seg.logprobs += [0.0] * len(between)
            seg.versions += [-1] * len(between)
            seg.mask += [0] * len(between)
        seg = out[-1]
        seg.response_ids += call.output_ids
        seg.logprobs += call.logprobs
        seg.versions += call.versions
        seg.mask += [1] * len(call.output_ids)
    return out


def _shared(a: list[int], b: list[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


Generate = Callable[[list[int], int], Awaitable[object]]  # (prompt ids, max new tokens) -> GenerationSample


class EpisodeSession:
    """One episode's calls. ``generate(ids, max_tokens)`` returns a GenerationSample (the workflow binds
    the engine client and its sampling settings); ``tool_parser`` names vLLM's parser for tool calls."""

    def __init__(self, chat: ChatFormat, generate: Generate, max_tokens: int, max_new_tokens: int,
                 tool_parser: str = tool_calls.DEFAULT_PARSER):  # fmt: skip
        self.key = "ep-" + secrets.token_hex(16)
        self.chat, self.generate = chat, generate
        self.max_tokens, self.max_new_tokens = max_tokens, max_new_tokens
        self.tool_parser = tool_parser
        self.calls: list[ChatCall] = []
        self.end_reason = ""  # "context" once a call found no room
        self._parser: tool_calls.ToolCallParser | None = None
        self._request: list[dict] | None = None  # the last request's messages
        self._tools: list[dict] | None = None  # and its tools
        self._messages: list[dict] | None = None  # the last request's messages + the reply returned
        self._ids: list[int] = []  # the last call's prompt + output
        self._closed = 0  # tokens of the segments before the current one

    @property
    def tokens(self) -> int:
        """Tokens of all the episode's segments (prompts, replies, messages between), a prefix a segment
        shares with the one before it counted once: what the budget counts."""
        return self._closed + len(self._ids)

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[list[int], bool]:
        """The prompt ids of a request and whether they continue the previous call's tokens."""
        prev = self._messages
        if prev is not None and tools == self._tools and messages[: len(prev)] == prev:
            rest = messages[len(prev) :]
            if rest and all(m["role"] != "assistant" for m in rest):
                ended = bool(self._ids) and self._ids[-1] == self.chat.end_of_turn_id
                return self._ids + self.chat.continuation_ids(rest, ended, tools), True
        return self.chat.messages_ids(messages, tools), False

    async def complete(self, messages: list[dict], max_tokens: int | None, tools: list[dict] | None = None,
                       parse_tools: bool = True) -> tuple[ChatCall, dict]:  # fmt: skip
        """Serve one request: its call record and the assistant message returned (``tool_calls`` parsed
        when ``tools`` are given and ``parse_tools``)."""
        ids, continues = self.prompt(messages, tools)
        closed = self._closed if continues else self._closed + len(self._ids) - _shared(self._ids, ids)
        room = self.max_tokens - closed - len(ids)
        if room < 1:
            self.end_reason = "context"
            raise ContextExceeded(
                f"This model's maximum context length is {self.max_tokens} tokens. However, your messages "
                f"resulted in {len(ids)} tokens (and the episode's earlier segments {closed}). Please "
                "reduce the length of the messages."
            )
        if tools and parse_tools and self._parser is None:  # an unknown parser is refused before generating
            self._parser = tool_calls.ToolCallParser(self.tool_parser, self.chat.tokenizer)
        limit = min(self.max_new_tokens, room, max_tokens or self.max_new_tokens)
        sample = await self.generate(ids, limit)
        out = list(sample.output_ids)
        # a compaction: earlier messages rewritten (not just a reply left out), the prompt shorter
        prev = self._request
        rewrote = prev is not None and messages[: len(prev)] != prev
        compacted = not continues and rewrote and len(ids) < len(self._ids)
        call = ChatCall(ids, out, list(sample.logprobs), list(sample.versions), sample.finish_reason or "stop",
                        continues, getattr(sample, "spec", None), compacted)  # fmt: skip
        self.calls.append(call)
        text = self.chat.tokenizer.decode(out, skip_special_tokens=True)
        reply = {"role": "assistant", "content": text}
        if tools and parse_tools:
            content, calls = self._parser.parse(text, tools)
            reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        self._request, self._tools, self._messages = messages, tools, [*messages, *normalize([reply])]
        self._closed, self._ids = closed, ids + out
        return call, reply


class Gateway:
    """The HTTP server (aiohttp, in the caller's event loop). ``open(...)`` makes an episode's session;
    ``close(session)`` ends it (later calls with its key get 401)."""

    def __init__(self):
        self.sessions: dict[str, EpisodeSession] = {}
        self._runner = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def open(self, session: EpisodeSession) -> EpisodeSession:
        self.sessions[session.key] = session
        return session

    def close(self, session: EpisodeSession) -> None:
        self.sessions.pop(session.key, None)

    def _session(self, request) -> EpisodeSession | None:
        auth = request.headers.get("Authorization", "")
        return self.sessions.get(auth[len("Bearer ") :]) if auth.startswith("Bearer ") else None

    @staticmethod
    def _error(status: int, message: str, kind: str = "invalid_request_error"):
        from aiohttp import web

        return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)

    async def _models(self, request):
        from aiohttp import web

        if self._session(request) is None:
            return self._error(401, "unknown or closed episode key", "authentication_error")
        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model"}]})

    async def _chat(self, request):
        from aiohttp import web

        session = self._session(request)
        if session is None:
            return self._error(401, "unknown or closed episode key", "authentication_error")
        try:
            body = await request.json()
            tools = tool_calls.normalize_tools(body["tools"]) if body.get("tools") else None
            choice = body.get("tool_choice") or "auto"
            if choice not in ("auto", "none"):
                raise ValueError("tool_choice must be auto or none: calls are read from the text, not forced")
            if body.get("stream"):
                raise ValueError("stream is not supported")
            if int(body.get("n", 1)) != 1:
                raise ValueError("n must be 1")
            messages = normalize(body.get("messages"))
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
            call, reply = await session.complete(messages, int(max_tokens) if max_tokens else None, tools,
                                                 parse_tools=choice != "none")  # fmt: skip
        except ContextExceeded as exc:
            return self._error(400, str(exc))
        except (ValueError, TypeError) as exc:
            return self._error(400, str(exc))
        finish = "tool_calls" if reply.get("tool_calls") else "stop"
        finish = "length" if call.finish_reason == "length" else finish
        n_in, n_out = len(call.prompt_ids), len(call.output_ids)
        return web.json_response({
            "id": f"chatcmpl-{len(session.calls)}-{session.key[-8:]}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model") or MODEL_NAME,
            "choices": [{"index": 0, "message": reply, "finish_reason": finish,
                         "logprobs": None, "token_ids": call.output_ids}],
            "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
            "prompt_token_ids": call.prompt_ids,
        })  # fmt: skip
