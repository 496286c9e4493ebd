"""Structured output end to end: `serve --model smollm2` with the official `openai` client
(json_schema through `beta.chat.completions.parse`, json_object, regex, choice, Lark and GBNF
grammars, logit_bias) and gRPC (the SamplingParams constraint oneof, a schema that does not
compile refused with INVALID_ARGUMENT); and a toy checkpoint served with and without n-gram
speculation giving the same greedy constrained tokens. Few and short requests: the 50 schemas x
5 samples run is bench/structured_output.py."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from pagedserve.v1 import generation_pb2
from tests.e2e.conftest import start_server
from tests.e2e.harness import text_request, token_request

QUESTION = "Describe a person called Anna who is 31 years old, as JSON."
PHONE = r"[0-9]{3}-[0-9]{4}"  # ASCII digits: \d also matches other scripts' decimal digits, as in Python


class Person(BaseModel):
    name: str
    age: int


SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
]


@pytest.fixture(scope="module")
def smollm2(smollm2_http):
    return smollm2_http


@pytest.fixture(scope="module")
def client(smollm2) -> OpenAI:
    return OpenAI(base_url=smollm2.http_url + "/v1", api_key="-", max_retries=0, timeout=240)


def _chat(client: OpenAI, content: str, **params):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": content}],
                                          **params)


def test_parse_returns_the_pydantic_object(client):
    completion = client.beta.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], response_format=Person,
        max_tokens=40, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Person), choice.message.content


def test_sampled_json_schema_outputs_validate(client):
    for schema in SCHEMAS:
        response = _chat(client, "Answer in JSON.", max_tokens=48, temperature=1.0, n=2, seed=7,
                         response_format={"type": "json_schema",
                                          "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        for choice in response.choices:
            if choice.finish_reason == "stop":
                jsonschema.validate(json.loads(choice.message.content), schema)
            else:  # cut by max_tokens: not valid JSON, as OpenAI says of `length`
                assert choice.finish_reason == "length"


def test_json_object_regex_choice_and_grammars_constrain(client):
    answer = _chat(client, "Give me a JSON object about cats.", max_tokens=40, temperature=0,
                   response_format={"type": "json_object"}).choices[0]
    if answer.finish_reason == "stop":
        assert isinstance(json.loads(answer.message.content), dict)
    else:
        assert answer.message.content.lstrip().startswith("{")
    phone = _chat(client, "What is a phone number?", max_tokens=12, temperature=1.0, seed=3,
                  extra_body={"structured_outputs": {"regex": PHONE}}).choices[0]
    assert re.fullmatch(PHONE, phone.message.content) and phone.finish_reason == "stop", phone
    mood = _chat(client, "Is 'I love it' positive or negative?", max_tokens=8, temperature=1.0,
                 extra_body={"guided_choice": ["positive", "negative"]}).choices[0]
    assert mood.message.content in ("positive", "negative") and mood.finish_reason == "stop"
    for grammar in ('root ::= "yes" | "no"', 'start: ("yes" | "no") "!"'):
        said = _chat(client, "Do you like tea?", max_tokens=8, temperature=1.0,
                     extra_body={"structured_outputs": {"grammar": grammar}}).choices[0]
        assert said.message.content in ("yes", "no", "yes!", "no!") and said.finish_reason == "stop", said


def test_logit_bias_bans_and_forces_tokens(smollm2, client):
    prompt = "The capital of France is"
    greedy = smollm2.stub.Generate(text_request(prompt, max_tokens=3, temperature=0), timeout=120).completions[0]
    first = greedy.token_ids[0]
    banned = smollm2.stub.Generate(text_request(prompt, max_tokens=3, logit_bias={first: -100.0}),
                                   timeout=120).completions[0]
    assert banned.token_ids[0] != first
    forced_id = smollm2.stub.Tokenize(generation_pb2.TokenizeRequest(text=" zebra"), timeout=10).token_ids[-1]
    forced = client.completions.create(model="smollm2", prompt=prompt, max_tokens=3, temperature=1.0,
                                       logit_bias={str(forced_id): 100})
    repeated = smollm2.stub.Tokenize(generation_pb2.TokenizeRequest(text=forced.choices[0].text), timeout=10)
    assert set(repeated.token_ids) == {forced_id}, forced.choices[0].text


def test_grpc_constraints_and_refusals(smollm2):
    schema = json.dumps(SCHEMAS[0])
    response = smollm2.stub.Generate(text_request("A city as JSON:", max_tokens=48, json_schema=schema), timeout=120)
    completion = response.completions[0]
    if completion.finish_reason == generation_pb2.FINISH_REASON_STOP:
        jsonschema.validate(json.loads(completion.text), SCHEMAS[0])
    choice = smollm2.stub.Generate(text_request("Pick one:", max_tokens=8, choice=generation_pb2.ChoiceList(
        choices=["alpha", "beta"])), timeout=120).completions[0]
    assert choice.text in ("alpha", "beta")
    for params, field in [({"json_schema": '{"type": "strin"}'}, "json_schema"), ({"regex": "(a"}, "regex"),
                          ({"grammar": "start: ??"}, "grammar"), ({"beam_width": 2, "regex": "a+"}, "beam_width"),
                          ({"logit_bias": {1: 150.0}}, "logit_bias")]:
        with pytest.raises(grpc.RpcError) as raised:
            smollm2.stub.Generate(text_request("x", max_tokens=4, **params), timeout=30)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert raised.value.details().startswith(field), raised.value.details()


def test_http_refuses_what_it_does_not_serve(client):
    with pytest.raises(openai.BadRequestError) as raised:
        _chat(client, "hi", max_tokens=4, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "not": {}}}})
    assert raised.value.body["param"] == "response_format" and "not" in raised.value.message
    with pytest.raises(openai.BadRequestError) as raised:
        _chat(client, "hi", max_tokens=4, extra_body={"guided_decoding_backend": "xgrammar"})
    assert raised.value.body["param"] == "guided_decoding_backend"


@pytest.fixture(scope="module")
def toy_servers(llama_checkpoint, tmp_path_factory):
    plain = start_server(llama_checkpoint, tmp_path_factory, "structured-plain", "--num-kv-blocks", "128")
    speculating = start_server(llama_checkpoint, tmp_path_factory, "structured-ngram", "--num-kv-blocks", "128",
                               "--speculative-method", "ngram", "--num-speculative-tokens", "3", metrics=True)
    yield plain, speculating
    assert plain.stop() == 0 and speculating.stop() == 0


def test_greedy_constrained_output_is_the_same_with_ngram_speculation(toy_servers):
    plain, speculating = toy_servers
    prompt = [1, 40, 41, 42, 40, 41, 42, 40, 41]
    constraints = [{"json_object": True}, {"regex": "(ab|cd)+e"},
                   {"json_schema": json.dumps({"type": "array", "items": {"type": "integer"}})}]
    for constraint in constraints:
        expected = plain.stub.Generate(token_request(prompt, max_tokens=40, **constraint), timeout=120)
        got = speculating.stub.Generate(token_request(prompt, max_tokens=40, **constraint), timeout=120)
        assert list(got.completions[0].token_ids) == list(expected.completions[0].token_ids), constraint
    drafts = re.search(r"^pagedserve_spec_decode_draft_tokens_total (\S+)", speculating.metrics("scheduler"), re.M)
    assert drafts and float(drafts.group(1)) > 0  # proposals were verified (and cut by the grammar)
