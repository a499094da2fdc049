"""Kimi K3 chat encoding ("XTML", architecture spec §11.2), rendered natively (no Jinja).

Layout (control tokens are specials; tag names, attributes and content are ordinary text):

    [<|open|>message role="system" type="tool-declare"<|sep|># Tools ... ```json\\n{tools}\\n```
        <|close|>message<|sep|><|end_of_msg|>]
    [<|open|>message role="system" type="thinking-effort"<|sep|>{effort}<|close|>message<|sep|><|end_of_msg|>]
    <|open|>message role="user"[ name=".."]<|sep|>{content}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|>
        [<|open|>think<|sep|>{reasoning}<|close|>think<|sep|>]
        <|open|>response<|sep|>{content}<|close|>response<|sep|>
        [<|open|>tools<|sep|><|open|>call tool="f" index="0"<|sep|>
            <|open|>argument key="k" type="string"<|sep|>{value}<|close|>argument<|sep|>...
         <|close|>call<|sep|>...<|close|>tools<|sep|>]
        <|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="tool" tool="f" index="0"<|sep|>{content}<|close|>message<|sep|><|end_of_msg|>

Choices of ours where the spec is silent: the thinking-effort message's body is the effort word;
call and tool-result ``index`` values count from 0 in the order of the assistant's ``tool_calls``.
The optional tool_choice and response_format system messages are not rendered.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from titan_kimi.data.tokenizer import KimiTokenizer

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
IMAGE_PLACEHOLDER = "<|kimi_image_placeholder|>"
THINKING_EFFORTS = ("low", "medium", "high", "max")
ROLES = ("system", "user", "assistant", "tool")
TOOLS_PREAMBLE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
TOOLS_POSTAMBLE = "\n```"


def escape_attribute(value: str) -> str:
    """Escapes an attribute value for ``key="value"`` (``&`` first, so escapes are not doubled)."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def _compact_json(value: Any, *, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys)


class _Renderer:
    """Appends tokens and their assistant-mask bits."""

    def __init__(self, tokenizer: KimiTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.mask: list[bool] = []
        specials = tokenizer.special_tokens
        needed = (OPEN, CLOSE, SEP, END_OF_MSG)
        missing = [name for name in needed if name not in specials]
        if missing:
            raise ValueError(f"tokenizer {tokenizer!r} lacks the chat special tokens {missing}")
        self._specials = specials

    def special(self, name: str, masked: bool = False) -> None:
        if name not in self._specials:
            raise ValueError(f"tokenizer {self.tokenizer!r} has no special token {name!r}")
        self.ids.append(self._specials[name])
        self.mask.append(masked)

    def text(self, text: str, masked: bool = False) -> None:
        ids = self.tokenizer.encode(text)  # never allow_special: content cannot inject control tokens
        self.ids.extend(ids)
        self.mask.extend([masked] * len(ids))

    def header(self, tag: str, masked: bool = False) -> None:
        """``<|open|>{tag}<|sep|>``; ``tag`` includes any attributes."""
        self.special(OPEN, masked)
        self.text(tag, masked)
        self.special(SEP, masked)

    def footer(self, tag_name: str, masked: bool = False) -> None:
        """``<|close|>{tag_name}<|sep|>``."""
        self.special(CLOSE, masked)
        self.text(tag_name, masked)
        self.special(SEP, masked)

    def content(self, content: Any, masked: bool = False) -> None:
        """A string, or a list of ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` parts."""
        if content is None:
            return
        if isinstance(content, str):
            self.text(content, masked)
            return
        if not isinstance(content, list):
            raise ValueError(f"message content must be a str or a list of parts, got {type(content).__name__}")
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                self.text(part.get("text", ""), masked)
            elif kind in ("image", "image_url"):
                self.special(IMAGE_PLACEHOLDER, masked)  # one placeholder per image (spec §16c)
            else:
                raise ValueError(f"content part {part!r} has type {kind!r}; valid types: text, image, image_url")


def _message_open(r: _Renderer, role: str, attributes: Sequence[tuple[str, str]] = ()) -> None:
    tag = f'message role="{role}"' + "".join(f' {k}="{escape_attribute(v)}"' for k, v in attributes)
    r.header(tag)


def _message_close(r: _Renderer, masked: bool = False) -> None:
    r.footer("message", masked)
    r.special(END_OF_MSG, masked)


def _tool_declaration(r: _Renderer, tools: list[Any]) -> None:
    _message_open(r, "system", [("type", "tool-declare")])
    r.text(TOOLS_PREAMBLE + _compact_json(tools, sort_keys=True) + TOOLS_POSTAMBLE)
    _message_close(r)


def _argument_type_and_text(value: Any) -> tuple[str, str]:
    if isinstance(value, str):
        return "string", value
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "boolean", "true" if value else "false"
    if isinstance(value, (int, float)):
        return "number", _compact_json(value)
    if value is None:
        return "null", "null"
    if isinstance(value, dict):
        return "object", _compact_json(value)
    if isinstance(value, list):
        return "array", _compact_json(value)
    raise ValueError(f"tool-call argument {value!r} of type {type(value).__name__} is not JSON-serialisable")


def _call_function(call: Any, position: int) -> dict[str, Any]:
    """Accepts OpenAI-style ``{"id", "function": {"name", "arguments"}}`` or a flat ``{"name", "arguments"}``."""
    if not isinstance(call, dict):
        raise ValueError(f"tool_calls[{position}] must be a dict, got {call!r}")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"tool_calls[{position}] has no function name: {call!r}")
    return fn


def _tool_calls(r: _Renderer, calls: list[Any]) -> None:
    r.header("tools", masked=True)
    for index, call in enumerate(calls):
        fn = _call_function(call, index)
        r.header(f'call tool="{escape_attribute(fn["name"])}" index="{index}"', masked=True)
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError:
                parsed = None
        else:
            parsed = arguments
        if isinstance(parsed, dict):
            for key, value in parsed.items():
                arg_type, text = _argument_type_and_text(value)
                r.header(f'argument key="{escape_attribute(str(key))}" type="{arg_type}"', masked=True)
                r.text(text, masked=True)
                r.footer("argument", masked=True)
        else:
            # Not a JSON object: keep the model's raw text in a json block.
            raw = arguments if isinstance(arguments, str) else _compact_json(arguments)
            r.header('json type="object"', masked=True)
            r.text(raw, masked=True)
            r.footer("json", masked=True)
        r.footer("call", masked=True)
    r.footer("tools", masked=True)


def _assistant(r: _Renderer, message: dict[str, Any], thinking: bool) -> None:
    _message_open(r, "assistant")  # the header is not trained on
    if thinking:
        r.header("think", masked=True)
        r.text(message.get("reasoning_content") or message.get("reasoning") or "", masked=True)
        r.footer("think", masked=True)
    r.header("response", masked=True)
    r.content(message.get("content"), masked=True)
    r.footer("response", masked=True)
    if message.get("tool_calls"):
        _tool_calls(r, message["tool_calls"])
    _message_close(r, masked=True)


def _tool_results(r: _Renderer, results: list[dict[str, Any]], calls: list[Any], first_row: int) -> None:
    """Renders a run of tool messages in the order of the assistant's ``tool_calls``."""
    position_of = {call.get("id"): i for i, call in enumerate(calls) if isinstance(call, dict)}
    ordered = []
    for offset, message in enumerate(results):
        call_id = message.get("tool_call_id")
        if call_id not in position_of:
            raise ValueError(
                f"messages[{first_row + offset}]: tool_call_id {call_id!r} matches none of the preceding "
                f"assistant's tool_calls ids {sorted(k for k in position_of if k is not None)}"
            )
        ordered.append((position_of[call_id], message))
    ordered.sort(key=lambda pair: pair[0])
    for index, message in ordered:
        name = _call_function(calls[index], index)["name"]
        _message_open(r, "tool", [("tool", name), ("index", str(index))])
        r.content(message.get("content"))
        _message_close(r)


def encode_chat(
    tokenizer: KimiTokenizer,
    messages: Sequence[dict[str, Any]],
    *,
    thinking: bool = False,
    thinking_effort: str = "max",
    tools: list[Any] | None = None,
    add_generation_prompt: bool = False,
) -> tuple[list[int], list[bool]]:
    """Encodes a conversation; returns ``(ids, assistant_mask)``. No BOS is inserted.

    ``assistant_mask[i]`` is True for every token of an assistant body, from ``<|open|>think`` (or
    ``<|open|>response`` when not thinking) through that message's ``<|end_of_msg|>``; the
    ``<|open|>message role="assistant"<|sep|>`` header and the generation prompt are False.
    ``thinking_effort`` is only rendered when ``thinking`` is on, but is always validated.
    """
    if thinking_effort not in THINKING_EFFORTS:
        raise ValueError(f"thinking_effort {thinking_effort!r} is not valid; choose one of {list(THINKING_EFFORTS)}")
    r = _Renderer(tokenizer)
    if tools:
        _tool_declaration(r, tools)
    if thinking:
        _message_open(r, "system", [("type", "thinking-effort")])
        r.text(thinking_effort)
        _message_close(r)

    last_calls: list[Any] = []
    i = 0
    while i < len(messages):
        message = messages[i]
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES:
            raise ValueError(f"messages[{i}] has role {role!r}; valid roles: {list(ROLES)}")
        if role == "tool":
            end = i
            while end < len(messages) and messages[end].get("role") == "tool":
                end += 1
            if not last_calls:
                raise ValueError(f"messages[{i}] is a tool result, but no assistant tool_calls precede it")
            _tool_results(r, list(messages[i:end]), last_calls, i)
            i = end
            continue
        if role == "assistant":
            _assistant(r, message, thinking)
            last_calls = list(message.get("tool_calls") or [])
        elif role == "system" and message.get("tools"):
            if message.get("content"):
                raise ValueError(f"messages[{i}]: a system message with 'tools' must not also have content")
            _tool_declaration(r, message["tools"])
        else:
            attributes = [("name", message["name"])] if message.get("name") else []
            _message_open(r, role, attributes)
            r.content(message.get("content"))
            _message_close(r)
        i += 1

    if add_generation_prompt:
        _message_open(r, "assistant")
        r.header("think" if thinking else "response")
    return r.ids, r.mask
