"""OpenAI request bodies -> SamplingParams, and the errors that name the field (no server)."""

from __future__ import annotations

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
    ({"logit_bias": {"1": 2.0}}, "logit_bias"),
    ({"best_of": 2}, "best_of"),
    ({"priority": 2**31}, "priority"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
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
    assert _param(lambda: _chat(tools=[{"type": "function"}])) == "tools"
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
