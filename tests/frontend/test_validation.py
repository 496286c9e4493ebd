"""GenerateRequest validation: defaults resolved as the contract pins them, bad fields named."""

from __future__ import annotations

import math

import pytest

from pagedserve.frontend.grpc.validation import ModelLimits, sampling_params_from_proto, validate_request
from pagedserve.contracts.sampling_params import InvalidParameter, SamplingParams
from pagedserve.v1 import generation_pb2 as pb

LIMITS = ModelLimits(max_model_len=64, vocab_size=100)


class CharEncoder:
    """One token per character (its code point), BOS = 1 in front."""

    def encode(self, text: str) -> list[int]:
        return [1, *(ord(c) for c in text)]


def _request(prompt: str | None = "hi", ids: list[int] | None = None, request_id: str = "",
             **params) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(request_id=request_id, params=pb.SamplingParams(**params))
    if ids is not None:
        msg.prompt_token_ids.ids.extend(ids)
        if not ids:
            msg.prompt_token_ids.SetInParent()
    elif prompt is not None:
        msg.prompt = prompt
    return msg


def test_proto3_zeros_resolve_to_the_pinned_defaults():
    params = sampling_params_from_proto(pb.SamplingParams())
    assert params == SamplingParams(max_tokens=16, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                                    repetition_penalty=1.0, n=1, beam_width=1, length_penalty=1.0)
    assert params.is_greedy and not params.is_beam_search


def test_explicit_values_are_kept():
    msg = pb.SamplingParams(max_tokens=5, min_tokens=2, temperature=0.7, top_p=0.9, top_k=4, min_p=0.1,
                            seed=0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=-0.5,
                            stop=["x"], stop_token_ids=[3], ignore_eos=True, include_stop_str_in_output=True,
                            n=3, length_penalty=0.0, logprobs=2)
    params = sampling_params_from_proto(msg)
    assert (params.max_tokens, params.min_tokens, params.top_k, params.seed, params.n) == (5, 2, 4, 0, 3)
    assert math.isclose(params.temperature, 0.7, rel_tol=1e-6) and math.isclose(params.top_p, 0.9, rel_tol=1e-6)
    assert params.length_penalty == 0.0, "an explicitly set length_penalty of 0 is not the default"
    assert params.stop == ["x"] and params.stop_token_ids == [3] and params.logprobs == 2
    assert params.ignore_eos and params.include_stop_str_in_output


def test_valid_text_and_token_prompts():
    text = validate_request(_request("hello", request_id="abc"), CharEncoder(), LIMITS)
    assert text.request_id == "abc"
    assert text.prompt_token_ids == [1, *map(ord, "hello")]
    tokens = validate_request(_request(ids=[5, 6, 99], max_tokens=61), CharEncoder(), LIMITS)
    assert tokens.prompt_token_ids == [5, 6, 99] and tokens.params.max_tokens == 61
    other = validate_request(_request(ids=[5]), CharEncoder(), LIMITS)
    assert len(tokens.request_id) >= 16 and tokens.request_id != other.request_id, "ids are generated"


BAD_REQUESTS = [
    ("no prompt", _request(None), "prompt"),
    ("empty prompt text", _request(""), "prompt"),
    ("empty prompt ids", _request(ids=[]), "prompt_token_ids"),
    ("token id out of vocabulary", _request(ids=[5, 100]), "prompt_token_ids"),
    ("prompt as long as max_model_len", _request(ids=[5] * 64), "prompt_token_ids"),
    ("text prompt too long", _request("x" * 70), "prompt"),
    ("prompt + max_tokens too long", _request(ids=[5] * 50, max_tokens=15), "max_tokens"),
    ("prompt + default max_tokens too long", _request(ids=[5] * 50), "max_tokens"),
    ("request id too long", _request(request_id="r" * 300), "request_id"),
    ("negative temperature", _request(temperature=-0.5), "temperature"),
    ("nan temperature", _request(temperature=float("nan")), "temperature"),
    ("top_p above 1", _request(top_p=1.5), "top_p"),
    ("negative top_p", _request(top_p=-0.1), "top_p"),
    ("negative top_k", _request(top_k=-1), "top_k"),
    ("min_p above 1", _request(min_p=1.5), "min_p"),
    ("seed too large", _request(seed=2**63), "seed"),
    ("negative repetition_penalty", _request(repetition_penalty=-1.0), "repetition_penalty"),
    ("presence_penalty out of range", _request(presence_penalty=3.0), "presence_penalty"),
    ("frequency_penalty out of range", _request(frequency_penalty=-2.5), "frequency_penalty"),
    ("min_tokens above max_tokens", _request(max_tokens=4, min_tokens=5), "min_tokens"),
    ("empty stop string", _request(stop=["ok", ""]), "stop"),
    ("too many stop strings", _request(stop=[str(i) for i in range(17)]), "stop"),
    ("stop token id out of vocabulary", _request(stop_token_ids=[100]), "stop_token_ids"),
    ("n too large", _request(n=65), "n"),
    ("beam_width too large", _request(beam_width=33), "beam_width"),
    ("beam search with temperature", _request(beam_width=2, temperature=0.5), "beam_width"),
    ("beam search with n", _request(beam_width=2, n=2), "n"),
    ("infinite length_penalty", _request(length_penalty=float("inf")), "length_penalty"),
    ("too many logprobs", _request(logprobs=21), "logprobs"),
    ("huge length_penalty", _request(beam_width=2, length_penalty=1e30), "length_penalty"),
    ("too many stop token ids", _request(stop_token_ids=list(range(65))), "stop_token_ids"),
    ("more beam candidates than the vocabulary", _request(beam_width=2, stop_token_ids=list(range(60))),
     "stop_token_ids"),
]


@pytest.mark.parametrize("request_msg, field_name", [(r, f) for _, r, f in BAD_REQUESTS],
                         ids=[name for name, _, _ in BAD_REQUESTS])
def test_bad_field_is_named(request_msg, field_name):
    with pytest.raises(InvalidParameter) as info:
        validate_request(request_msg, CharEncoder(), LIMITS)
    assert info.value.field_name == field_name
    assert str(info.value).startswith(f"{field_name}: ")


def test_length_error_says_how_much_fits():
    with pytest.raises(InvalidParameter, match=r"max_model_len 64.*at most 14 tokens"):
        validate_request(_request(ids=[5] * 50, max_tokens=20), CharEncoder(), LIMITS)
    with pytest.raises(InvalidParameter, match=r"max_tokens 0 means 16"):
        validate_request(_request(ids=[5] * 50), CharEncoder(), LIMITS)


class WordChat:
    """Renders messages as 'role: content' lines, one token per character."""

    def encode(self, messages, add_generation_prompt=True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if add_generation_prompt else "")
        return [ord(c) % 100 for c in text]


def test_chat_messages_are_rendered_by_the_chat_template():
    messages = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    validated = validate_request(pb.GenerateRequest(messages=messages), CharEncoder(), LIMITS, WordChat())
    assert validated.prompt_token_ids == WordChat().encode([{"role": "user", "content": "hi"}])
    messages.add_generation_prompt = False
    continued = validate_request(pb.GenerateRequest(messages=messages), CharEncoder(), LIMITS, WordChat())
    assert len(continued.prompt_token_ids) == len(validated.prompt_token_ids) - len("assistant:")


@pytest.mark.parametrize("messages, chat, message", [
    (pb.ChatMessages(), WordChat(), "must not be empty"),
    (pb.ChatMessages(messages=[pb.ChatMessage(content="hi")]), WordChat(), "no role"),
    (pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")]), None, "no chat messages"),
])
def test_bad_chat_messages_are_named(messages, chat, message):
    with pytest.raises(InvalidParameter, match=message) as info:
        validate_request(pb.GenerateRequest(messages=messages), CharEncoder(), LIMITS, chat)
    assert info.value.field_name == "messages"


def test_text_is_refused_by_its_utf8_length_before_it_is_tokenized():
    from pagedserve.frontend.grpc.validation import MIN_MAX_PROMPT_BYTES, check_text_bytes, max_prompt_bytes

    assert max_prompt_bytes(16) == MIN_MAX_PROMPT_BYTES and max_prompt_bytes(100_000) == 1_600_000
    check_text_bytes("prompt", ["a" * 1000], 1000)
    check_text_bytes("prompt", ["é" * 500], 1000)  # 1000 bytes
    for texts in (["é" * 501], ["a" * 1001], ["a" * 600, "b" * 401], ["😀" * 251]):
        with pytest.raises(InvalidParameter) as info:
            check_text_bytes("prompt", texts, 1000)
        assert info.value.field_name == "prompt"
