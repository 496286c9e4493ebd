"""Tool-call parsers on canned model outputs (single, parallel, text around, unicode and escaped
quotes, malformed) and their streams cut at every character boundary: the concatenated deltas
equal the whole answer."""

from __future__ import annotations

import json
import random

import pytest

from pagedserve.frontend.tools.tool_parsers import PARSERS, UnknownToolParser, get_parser
from pagedserve.frontend.tools.tool_stream import ToolStream, message_content

ARGS = {"city": "Zürich \"old town\" 東京 \\ 🙂", "days": 3}
ARGS_TEXT = json.dumps(ARGS, ensure_ascii=False)


def _hermes(name, args):
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}\n</tool_call>'


def _smol(*calls):
    items = ",\n".join(f'{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}'
                       for name, args in calls)
    return f"<tool_call>[\n{items}\n]</tool_call>"


def _llama(*calls):
    return "; ".join(json.dumps({"name": name, "parameters": args}, ensure_ascii=False) for name, args in calls)


# (parser, text, expected content, expected [(name, args)])
CASES = [
    ("hermes", _hermes("weather", ARGS), None, [("weather", ARGS)]),
    ("hermes", _hermes("a", {}) + "\n" + _hermes("b", {"x": [1, 2]}), None, [("a", {}), ("b", {"x": [1, 2]})]),
    ("hermes", "Let me look.\n" + _hermes("weather", ARGS) + "\nDone.", "Let me look.\n\nDone.", [("weather", ARGS)]),
    ("hermes", "no calls here < tool_call >", "no calls here < tool_call >", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", "<tool_call>" + json.dumps({"name": "f", "arguments": "{\"a\": 1}"}) + "</tool_call>", None,
     [("f", {"a": 1})]),
    ("hermes", "text <tool_call>{\"name\": \"f\", \"arguments\": {}}", "text <tool_call>{\"name\": \"f\", \"arguments\": {}}", []),
    ("smollm2", _smol(("weather", ARGS)), None, [("weather", ARGS)]),
    ("smollm2", _smol(("a", {"q": "x"}), ("b", ARGS)), None, [("a", {"q": "x"}), ("b", ARGS)]),
    ("smollm2", "Sure! " + _smol(("a", {})) + " bye", "Sure!  bye", [("a", {})]),
    ("smollm2", "<tool_call>[]</tool_call>", "", []),
    ("smollm2", "<tool_call>[{\"name\": \"a\"}, 3]</tool_call>", "<tool_call>[{\"name\": \"a\"}, 3]</tool_call>", []),
    ("smollm2", "<tool_call>[{\"name\": \"a\", \"arguments\": [1]}]</tool_call>",
     "<tool_call>[{\"name\": \"a\", \"arguments\": [1]}]</tool_call>", []),
    ("smollm2", "<tool_call></tool_call></tool_call>", "<tool_call></tool_call></tool_call>", []),
    ("llama3_json", _llama(("weather", ARGS)), None, [("weather", ARGS)]),
    ("llama3_json", "<|python_tag|>" + _llama(("a", {}), ("b", ARGS)), None, [("a", {}), ("b", ARGS)]),
    ("llama3_json", "  " + _llama(("a", {"n": None})) + "\n", None, [("a", {"n": None})]),
    ("llama3_json", "The answer is {\"name\": \"a\"}", "The answer is {\"name\": \"a\"}", []),
    ("llama3_json", _llama(("a", {})) + " and then", _llama(("a", {})) + " and then", []),
    ("llama3_json", "{\"name\": \"a\", \"parameters\": {}", "{\"name\": \"a\", \"parameters\": {}", []),
]


def _calls(calls):
    return [(call.name, json.loads(call.arguments_json)) for call in calls]


def _streamed(parser_name, pieces):
    stream = ToolStream(get_parser(parser_name))
    deltas = [delta for piece in pieces for delta in stream.feed(piece)] + stream.finish()
    content, calls = None, {}
    for delta in deltas:
        if "content" in delta:
            content = (content or "") + delta["content"]
        for item in delta.get("tool_calls", []):
            call = calls.setdefault(item["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in item:
                assert call["id"] is None and item["type"] == "function", "id, type and name come once"
                call["id"], call["name"] = item["id"], item["function"]["name"]
            call["arguments"] += item["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    if content is None and not calls:
        content = ""  # the stream's opening delta has content ""
    return content, [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)], calls


def _whole(parser_name, text):
    parsed = get_parser(parser_name).parse(text)
    return (message_content(parsed) if parsed.calls else parsed.content), _calls(parsed.calls)


@pytest.mark.parametrize("parser_name,text,content,calls", CASES)
def test_whole_output(parser_name, text, content, calls):
    parsed = get_parser(parser_name).parse(text)
    assert _calls(parsed.calls) == calls
    assert message_content(parsed) == (content if calls else content or "")
    assert all(call.id.startswith("call_") for call in parsed.calls)
    assert len({call.id for call in parsed.calls}) == len(parsed.calls)


@pytest.mark.parametrize("parser_name,text,content,calls", CASES)
def test_stream_cut_at_every_boundary(parser_name, text, content, calls):
    expected = _whole(parser_name, text)
    assert _streamed(parser_name, list(text))[:2] == expected  # one character at a time
    for cut in range(len(text) + 1):
        assert _streamed(parser_name, [text[:cut], text[cut:]])[:2] == expected, cut


def test_utf8_byte_boundaries_of_a_call():
    """Pieces as an incremental UTF-8 decoder yields them at every byte cut of the output."""
    import codecs

    text = "Voilà " + _smol(("weather", ARGS))
    data = text.encode("utf-8")
    for cut in range(len(data) + 1):
        decoder = codecs.getincrementaldecoder("utf-8")()
        pieces = [decoder.decode(data[:cut]), decoder.decode(data[cut:], final=True)]
        assert _streamed("smollm2", pieces)[:2] == ("Voilà ", [("weather", ARGS)])


def test_partial_tag_is_held_back():
    stream = ToolStream(get_parser("smollm2"))
    assert stream.feed("Hi <tool_") == [{"content": "Hi"}]
    assert stream.feed("call>[{\"name\": \"f\", ") == []
    deltas = stream.feed("\"arguments\": {}}]</tool_call>")
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert deltas[1]["tool_calls"][0]["function"] == {"arguments": "{}"}
    assert stream.finish() == [{"content": " "}]  # the held trailing space of "Hi "


def test_a_partial_tag_that_is_not_a_tag_becomes_content():
    stream = ToolStream(get_parser("hermes"))
    assert stream.feed("a <tool") == [{"content": "a"}]
    assert stream.feed("box") == [{"content": " <toolbox"}]


def test_malformed_fuzz_never_raises_and_streams_consistently():
    rng = random.Random(25)
    atoms = ["<tool_call>", "</tool_call>", "<tool_", "[", "]", "{", "}", '"name"', '"arguments"', '"parameters"',
             ":", ",", ";", '"f"', '"é\\""', "\\", "null", "1", " ", "\n", "<|python_tag|>", "\ud83d\ude42", "'"]
    good = [_smol(("f", {"a": 1})), _hermes("g", ARGS), _llama(("h", {}))]
    for _ in range(1000):
        parts = [rng.choice(atoms) for _ in range(rng.randint(0, 14))]
        if rng.random() < 0.3:
            parts.insert(rng.randint(0, len(parts)), rng.choice(good))
        text = "".join(parts)
        for name in PARSERS:
            expected = _whole(name, text)
            cut = rng.randint(0, len(text))
            assert _streamed(name, [text[:cut], text[cut:]])[:2] == expected


def test_unknown_parser():
    with pytest.raises(UnknownToolParser, match="hermes"):
        get_parser("nope")
