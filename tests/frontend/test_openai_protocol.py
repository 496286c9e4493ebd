"""OpenAI request bodies -> SamplingParams, and the errors that name the field (no server)."""

from __future__ import annotations

import json

import pytest

from pagedserve.frontend.openai.protocol import (
    ChatCompletionBody, CompletionBody, chat_messages, generation_plan, parse_body, prompts_of,
)
from pagedserve.contracts.sampling_params import InvalidParameter


def _completion(**fields):
    return generation_plan(parse_body(CompletionBody, {"prompt": "hi", **fields}))


def _chat(**fields):
    return generation_plan(parse_body(ChatCompletionBody, {"messages": [{"role": "user", "content": "hi"}],
                                                           **fields}))


def _param(call) -> str:
    with pytest.raises(InvalidParameter) as raised:
        call()
    return raised.value.field_name


def test_openai_defaults():
    plan = _completion()
    assert (plan.params.max_tokens, plan.params.temperature, plan.params.top_p, plan.params.n) == (16, 1.0, 1.0, 1)
    assert plan.num_top_logprobs is None and not plan.is_stream and not plan.echo
    chat = _chat()
    assert chat.max_tokens is None  # the rest of the context, resolved per prompt
    assert chat.resolve(num_prompt_tokens=10, max_model_len=100).max_tokens == 90


def test_max_completion_tokens_wins_and_is_the_field_blamed():
    plan = _chat(max_tokens=50, max_completion_tokens=5)
    assert plan.params.max_tokens == 5 and plan.max_tokens_field == "max_completion_tokens"
    assert _param(lambda: _chat(max_tokens=5, max_completion_tokens=0)) == "max_completion_tokens"


def test_vllm_extras_and_beam_search():
    plan = _completion(top_k=-1, min_p=0.1, repetition_penalty=1.2, min_tokens=2, ignore_eos=True,
                       include_stop_str_in_output=True, stop="x", stop_token_ids=[7])
    params = plan.params
    assert (params.top_k, params.min_p, params.repetition_penalty, params.min_tokens) == (0, 0.1, 1.2, 2)
    assert params.ignore_eos and params.include_stop_str_in_output
    assert (params.stop, params.stop_token_ids) == (["x"], [7])
    beam = _completion(use_beam_search=True, n=2, best_of=4, length_penalty=0.5)
    assert (beam.params.beam_width, beam.params.n, beam.params.temperature, beam.num_choices) == (4, 1, 0.0, 2)
    assert beam.params.length_penalty == 0.5


def test_logprobs_ask_for_at_least_one_alternative():
    assert (_completion(logprobs=0).params.logprobs, _completion(logprobs=0).num_top_logprobs) == (1, 0)
    assert _completion(logprobs=3).params.logprobs == 3
    chat = _chat(logprobs=True, top_logprobs=4)
    assert (chat.params.logprobs, chat.num_top_logprobs) == (4, 4)
    assert _chat(logprobs=False).num_top_logprobs is None


@pytest.mark.parametrize("fields, param", [
    ({"n": "2"}, "n"),
    ({"temperature": True}, "temperature"),
    ({"stop": 5}, "stop"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"logit_bias": {"x": 2.0}}, "logit_bias"),
    ({"best_of": 2}, "best_of"),
    ({"priority": 2**31}, "priority"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": "start: ??"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_json": {"not": {}}}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"suffix": "x"}, "suffix"),
    ({"logprobs": 21}, "logprobs"),
    ({"echo": True, "logprobs": 1}, "logprobs"),
    ({"top_k": 2**31}, "top_k"),
    ({"length_penalty": 2.0}, "length_penalty"),
])
def test_completion_errors_name_the_field(fields, param):
    assert _param(lambda: _completion(**fields)) == param


def test_priority_flows_through():
    assert _completion(priority=3).priority == 3
    assert _chat(priority=-2).priority == -2
    assert _completion().priority == 0


def test_chat_errors_name_the_field():
    assert _param(lambda: _chat(top_logprobs=2)) == "top_logprobs"
    assert _param(lambda: _chat(tools=[{"type": "function"}])) == "tools[0].function"
    body = parse_body(ChatCompletionBody, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert _param(lambda: chat_messages(body.messages)) == "messages[0].content[0]"
    assert _param(lambda: parse_body(ChatCompletionBody, {"messages": [{"role": 1}]})) == "messages[0].role"
    assert _param(lambda: parse_body(ChatCompletionBody, {})) == "messages"
    assert _param(lambda: parse_body(ChatCompletionBody, [])) == "body"


def test_content_parts_join_with_newlines():
    body = parse_body(ChatCompletionBody, {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]})
    assert chat_messages(body.messages) == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": ""}]


def test_prompt_shapes():
    assert prompts_of(parse_body(CompletionBody, {"prompt": "a"})) == ["a"]
    assert prompts_of(parse_body(CompletionBody, {"prompt": [1, 2]})) == [[1, 2]]
    assert prompts_of(parse_body(CompletionBody, {"prompt": [[1], [2]]})) == [[1], [2]]
    assert prompts_of(parse_body(CompletionBody, {"prompt": ["a", "b"]})) == ["a", "b"]
    assert _param(lambda: prompts_of(parse_body(CompletionBody, {"prompt": []}))) == "prompt"
    assert _param(lambda: prompts_of(parse_body(CompletionBody, {"prompt": ["a", ""]}))) == "prompt[1]"


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"100": -1}}, "logit_bias"),
    ({"use_beam_search": True, "n": 2, "temperature": 0, "guided_choice": ["a", "b"]}, "beam_width"),
    ({"min_tokens": 2, "guided_choice": ["a", "b"]}, "min_tokens"),
])
def test_structured_parameters_are_range_checked_with_the_others(fields, param):
    params = _completion(**fields).params
    with pytest.raises(InvalidParameter) as raised:
        params.validate(vocab_size=100)
    assert raised.value.field_name == param


def test_every_structured_output_spelling_gives_its_constraint():
    from pagedserve.contracts.constraint import ConstraintKind as Kind
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}},
         Kind.JSON_SCHEMA),
        ({"response_format": {"type": "json_object"}}, Kind.JSON_OBJECT),
        ({"structured_outputs": {"json": schema}}, Kind.JSON_SCHEMA),
        ({"structured_outputs": {"regex": "[0-9]+"}}, Kind.REGEX),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, Kind.CHOICE),
        ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, Kind.GRAMMAR),
        ({"guided_json": json.dumps(schema)}, Kind.JSON_SCHEMA),
        ({"guided_regex": "a+"}, Kind.REGEX),
        ({"guided_choice": ["a"]}, Kind.CHOICE),
        ({"guided_grammar": 'start: "x"'}, Kind.GRAMMAR),
    ]
    for fields, kind in cases:
        assert _chat(**fields).params.constraint.kind is kind, fields
    assert _chat(response_format={"type": "text"}).params.constraint is None
    assert _completion(logit_bias={"7": -100, "9": 5.5}).params.logit_bias == {7: -100.0, 9: 5.5}


def test_unserved_fields_are_refused_and_unknown_ones_reported():
    from pagedserve.frontend.openai.protocol import unknown_fields
    body = {"messages": [], "skip_special_tokens": True, "store": False, "my_field": 1, "user": "u"}
    assert unknown_fields(ChatCompletionBody, body) == ["my_field"]
    for field, value in (("chat_template", "{{ x }}"), ("skip_special_tokens", False), ("store", True),
                         ("prediction", {"type": "content"}), ("allowed_token_ids", [1])):
        with pytest.raises(InvalidParameter) as raised:
            unknown_fields(ChatCompletionBody, {"messages": [], field: value})
        assert raised.value.field_name == field
