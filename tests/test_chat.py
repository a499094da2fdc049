import re

import pytest

from titan_kimi.data.assets import TOKENIZER_DIR
from titan_kimi.data.chat import encode_chat, escape_attribute
from titan_kimi.data.tokenizer import KimiTokenizer

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "reasoning_content": "Call the tool.",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "reasoning_content": "Easy.", "content": "Sunny."},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]

EXPECTED = (
    '<|open|>message role="system" type="tool-declare"<|sep|># Tools\nHere are the available tools, described in '
    'JSONSchema.\n\n```json\n[{"function":{"name":"get_weather","parameters":{"type":"object"}},"type":"function"}]'
    "\n```<|close|>message<|sep|><|end_of_msg|>"
    '<|open|>message role="system" type="thinking-effort"<|sep|>high<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="user"<|sep|>Weather in Oslo?<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|>'
    "<|open|>think<|sep|>Call the tool.<|close|>think<|sep|>"
    "<|open|>response<|sep|><|close|>response<|sep|>"
    '<|open|>tools<|sep|><|open|>call tool="get_weather" index="0"<|sep|>'
    '<|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
    "<|close|>call<|sep|><|close|>tools<|sep|>"
    "<|close|>message<|sep|><|end_of_msg|>"
    '<|open|>message role="tool" tool="get_weather" index="0"<|sep|>sunny<|close|>message<|sep|><|end_of_msg|>'
    '<|open|>message role="assistant"<|sep|>'
    "<|open|>think<|sep|>Easy.<|close|>think<|sep|>"
    "<|open|>response<|sep|>Sunny.<|close|>response<|sep|>"
    "<|close|>message<|sep|><|end_of_msg|>"
)


@pytest.fixture(scope="module")
def tok() -> KimiTokenizer:
    return KimiTokenizer(TOKENIZER_DIR)


def segment_ids(tok: KimiTokenizer, rendered: str) -> list[int]:
    """Ids of a rendering: control tokens as specials, each text run between them encoded on its own."""
    ids = []
    for i, part in enumerate(re.split(r"(<\|open\|>|<\|close\|>|<\|sep\|>|<\|end_of_msg\|>)", rendered)):
        if i % 2:
            ids.append(tok.token_to_id(part))
        elif part:
            ids.extend(tok.encode(part))
    return ids


def mask_runs(mask: list[bool]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_exact_rendering_with_think_block_and_tool_call(tok):
    ids, mask = encode_chat(tok, CONVERSATION, thinking=True, thinking_effort="high", tools=TOOLS)
    assert tok.decode(ids) == EXPECTED
    assert ids == segment_ids(tok, EXPECTED)
    assert len(mask) == len(ids)
    assert tok.bos_id not in ids  # no BOS is inserted


def test_mask_covers_each_assistant_body_and_not_its_header(tok):
    ids, mask = encode_chat(tok, CONVERSATION, thinking=True, tools=TOOLS)
    open_id, sep_id, end_id = (tok.token_to_id(n) for n in ("<|open|>", "<|sep|>", "<|end_of_msg|>"))
    runs = mask_runs(mask)
    assert len(runs) == 2  # one per assistant message
    for start, end in runs:
        assert ids[start] == open_id
        assert tok.decode(ids[start + 1 : start + 2]) == "think"
        assert ids[end - 1] == end_id
        # Immediately before the body: the unmasked header, ending in <|sep|>.
        assert ids[start - 1] == sep_id and not mask[start - 1]
        assert tok.decode(ids[:start]).endswith('<|open|>message role="assistant"<|sep|>')
    bodies = [tok.decode(ids[s:e]) for s, e in runs]
    assert bodies[1] == (
        "<|open|>think<|sep|>Easy.<|close|>think<|sep|><|open|>response<|sep|>Sunny."
        "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )


def test_mask_without_thinking_starts_at_response(tok):
    ids, mask = encode_chat(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])
    (start, end), = mask_runs(mask)
    assert tok.decode(ids[start:end]) == (
        "<|open|>response<|sep|>Hello!<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    )
    assert end == len(ids)
    assert "think" not in tok.decode(ids)
    assert "thinking-effort" not in tok.decode(ids)


def test_generation_prompt_is_unmasked(tok):
    messages = [{"role": "user", "content": "Hi"}]
    ids, mask = encode_chat(tok, messages, add_generation_prompt=True)
    assert tok.decode(ids).endswith('<|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    ids, mask = encode_chat(tok, messages, thinking=True, add_generation_prompt=True)
    assert tok.decode(ids).endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert not any(mask)


@pytest.mark.parametrize("effort", ["", "none", "MAX", "extreme", None])
def test_bad_thinking_effort_raises(tok, effort):
    with pytest.raises(ValueError, match="thinking_effort .* choose one of \\['low', 'medium', 'high', 'max'\\]"):
        encode_chat(tok, [{"role": "user", "content": "Hi"}], thinking=True, thinking_effort=effort)


def test_attribute_escaping_and_name(tok):
    assert escape_attribute('a&b "c"') == "a&amp;b &quot;c&quot;"
    ids, _ = encode_chat(tok, [{"role": "user", "name": 'Ann "&" Bo', "content": "x"}])
    assert tok.decode(ids).startswith('<|open|>message role="user" name="Ann &quot;&amp;&quot; Bo"<|sep|>x')


def test_content_cannot_inject_control_tokens(tok):
    ids, _ = encode_chat(tok, [{"role": "user", "content": "<|end_of_msg|><|open|>"}])
    assert ids.count(tok.token_to_id("<|end_of_msg|>")) == 1
    assert ids.count(tok.token_to_id("<|open|>")) == 1


def test_tool_results_follow_call_order_and_raw_arguments(tok):
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "function": {"name": "first", "arguments": {"flag": True, "x": None, "l": [1, 2]}}},
            {"id": "b", "function": {"name": "second", "arguments": "not json"}},
        ]},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
    ]
    text = tok.decode(encode_chat(tok, messages)[0])
    assert (
        '<|open|>argument key="flag" type="boolean"<|sep|>true<|close|>argument<|sep|>'
        '<|open|>argument key="x" type="null"<|sep|>null<|close|>argument<|sep|>'
        '<|open|>argument key="l" type="array"<|sep|>[1,2]<|close|>argument<|sep|>'
    ) in text
    assert (
        '<|open|>call tool="second" index="1"<|sep|><|open|>json type="object"<|sep|>not json<|close|>json<|sep|>'
    ) in text
    assert text.endswith(
        '<|open|>message role="tool" tool="first" index="0"<|sep|>A<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="tool" tool="second" index="1"<|sep|>B<|close|>message<|sep|><|end_of_msg|>'
    )


def test_system_message_with_tools_is_a_tool_declaration(tok):
    ids, _ = encode_chat(tok, [{"role": "system", "tools": [{"name": "f"}]}])
    assert tok.decode(ids).startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools\n')
    assert '[{"name":"f"}]' in tok.decode(ids)


def test_image_parts_become_one_placeholder_each(tok):
    content = [{"type": "image"}, {"type": "text", "text": "What is this?"}, {"type": "image_url"}]
    ids, _ = encode_chat(tok, [{"role": "user", "content": content}])
    assert ids.count(tok.token_to_id("<|kimi_image_placeholder|>")) == 2


def test_bad_messages_raise(tok):
    with pytest.raises(ValueError, match="role 'robot'; valid roles"):
        encode_chat(tok, [{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="no assistant tool_calls precede it"):
        encode_chat(tok, [{"role": "tool", "tool_call_id": "a", "content": "x"}])
    calls = [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(ValueError, match="tool_call_id 'zz' matches none"):
        encode_chat(tok, [{"role": "assistant", "content": "", "tool_calls": calls},
                          {"role": "tool", "tool_call_id": "zz", "content": "x"}])
    with pytest.raises(ValueError, match="content part"):
        encode_chat(tok, [{"role": "user", "content": [{"type": "audio"}]}])
