"""The frontend's tokenizer read with the `tokenizers` library alone (plain_tokenizer.py,
chat_rendering.py): the same ids, texts, special tokens and chat prompts as transformers'
AutoTokenizer on the same folder; the folders it leaves to transformers; a frontend that loads
its tokenizer and renders chats without importing torch or transformers."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.checkpoints.tiny_tokenizer import build_tokenizer
from pagedserve.frontend.tokenization.plain_tokenizer import load_plain_tokenizer
from pagedserve.frontend.tokenization.tokenizer import PLAIN, TRANSFORMERS, load_tokenizer
from pagedserve.frontend.tools.tool_templates import SMOLLM2_TOOLS
from tests.e2e.conftest import CHAT_TEMPLATE

TEXTS = ["The old lighthouse stood at the edge of the harbour.", "naïve café, 3 € — ★ 你好 🙂",
         "  two  spaces\n\nand lines\t", "", " ", "<s>inside</s> and <pad><unk>", "<|im_start|>user\nhi<|im_end|>",
         "<|endoftext|>tail", "x" * 300]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "Ünïcode city"}},
                                               "required": ["city"]}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? ★"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"}],
    [{"role": "user", "content": "Think first."}, {"role": "assistant", "content": "Done.", "reasoning": "step"}],
]
FEATURES_TEMPLATE = (
    "{%- set ns = namespace(count=0) -%}"
    "{%- for message in messages -%}{%- if loop.index > 3 %}{% break %}{% endif -%}"
    "{%- set ns.count = ns.count + 1 -%}\n"
    "  {% generation %}[{{ message.role }}]{% endgeneration %} {{ message.content | default('-') }}\n"
    "{%- if message.tool_calls is defined %}{{ message.tool_calls | tojson(indent=2) }}{% endif %}"
    "{%- if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{%- if message.thinking is defined %}/{{ message.thinking }}{% endif %}\n"
    "    {% if loop.last %}\n(last)\n    {% endif %}\n"
    "{% endfor -%}"
    "{{ dict(a=1, b='é') | tojson }}{{ ns.count }}{{ bos_token }}{{ eos_token }}{{ pad_token }}"
    "{%- if tools %}{{ tools | tojson(sort_keys=true, separators=(',', ':')) }}{% endif %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}")
RAISING_TEMPLATE = "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}ok"


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory) -> Path:
    folder = build_tokenizer(tmp_path_factory.mktemp("tiny-chat"), vocab_size=512)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    """The real model's tokenizer folder, as the frontend caches it from the GGUF file."""
    from pagedserve.checkpoints.smollm2 import ensure_smollm2
    from pagedserve.frontend.tokenization.gguf_tokenizer import tokenizer_cache_path

    gguf = ensure_smollm2()
    load_tokenizer(gguf)  # converts and caches it the first time
    return tokenizer_cache_path(gguf)


def _render_both(hf, plain, template, messages, tools, add_generation_prompt):
    outcomes = []
    for render in (lambda: hf.apply_chat_template(messages, chat_template=template, tokenize=False, tools=tools,
                                                  add_generation_prompt=add_generation_prompt),
                   lambda: plain.apply_chat_template(messages, chat_template=template, tokenize=False, tools=tools,
                                                     add_generation_prompt=add_generation_prompt)):
        try:
            outcomes.append(("text", render()))
        except Exception as exc:  # both must refuse alike
            outcomes.append(("error", type(exc).__name__))
    return outcomes


def _assert_same_as_transformers(folder: Path, templates: list[str], num_token_texts: int) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    plain, why_not = load_plain_tokenizer(folder)
    assert plain is not None, why_not
    assert (len(plain), plain.bos_token_id, plain.eos_token_id) == (len(hf), hf.bos_token_id, hf.eos_token_id)
    assert plain.chat_template == hf.chat_template
    for text in TEXTS:
        for add_special_tokens in (True, False):
            assert plain.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(hf) + 4) for _ in range(rng.randrange(1, 24))]  # unknown ids too
        for skip in (True, False):
            assert plain.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    for token_id in rng.sample(range(len(hf)), min(num_token_texts, len(hf))):
        assert plain.decode([token_id]) == hf.decode([token_id], skip_special_tokens=False,
                                                     clean_up_tokenization_spaces=False)
    for template in templates:
        for messages in CONVERSATIONS:
            for tools in (None, TOOLS):
                for add_generation_prompt in (True, False):
                    theirs, ours = _render_both(hf, plain, template, messages, tools, add_generation_prompt)
                    assert ours == theirs, (template[:60], messages, tools)


def test_tiny_tokenizer_folder_gives_transformers_results(chat_folder):
    assert load_tokenizer(chat_folder).backend == PLAIN
    _assert_same_as_transformers(chat_folder, [CHAT_TEMPLATE, FEATURES_TEMPLATE, RAISING_TEMPLATE, SMOLLM2_TOOLS],
                                 num_token_texts=512)


def test_smollm2_tokenizer_folder_gives_transformers_results(smollm2_folder):
    plain, _ = load_plain_tokenizer(smollm2_folder)
    _assert_same_as_transformers(smollm2_folder, [plain.chat_template, SMOLLM2_TOOLS, FEATURES_TEMPLATE],
                                 num_token_texts=3000)


def test_the_smollm2_gguf_model_loads_without_transformers(smollm2_folder):
    from pagedserve.checkpoints.smollm2 import smollm2_path

    assert load_tokenizer(smollm2_path()).backend == PLAIN


def _edited_copy(source: Path, target: Path, **changes) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config.update(changes)
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(("changes", "reason"), [
    ({"tokenizer_class": "LlamaTokenizerFast"}, "tokenizer_class"),
    ({"split_special_tokens": True}, "split_special_tokens"),
    ({"extra_special_tokens": ["<|not_added|>"]}, "not added tokens"),
    ({"chat_template": [{"name": "default", "template": "x"}]}, "several chat templates"),
    ({"added_tokens_decoder": {"1": {"content": "<s>", "special": True, "lstrip": True, "rstrip": False,
                                     "normalized": False, "single_word": False}}}, "differs"),
])
def test_folders_that_transformers_would_change_go_to_transformers(chat_folder, tmp_path, changes, reason):
    folder = _edited_copy(chat_folder, tmp_path / "edited", **changes)
    plain, why_not = load_plain_tokenizer(folder)
    assert plain is None and reason in why_not
    tokenizer = load_tokenizer(folder)
    assert tokenizer.backend == TRANSFORMERS
    assert tokenizer.encode("hello there") == load_tokenizer(chat_folder).encode("hello there")


def test_a_legacy_special_tokens_map_overrides_the_config_as_in_transformers(chat_folder, tmp_path):
    folder = _edited_copy(chat_folder, tmp_path / "legacy", eos_token="<unk>")
    # no added_tokens_decoder in the config: transformers reads special_tokens_map.json over it
    assert load_plain_tokenizer(folder)[0].eos_token_id == load_tokenizer(chat_folder).info.eos_token_ids[0]
    _assert_same_as_transformers(folder, [CHAT_TEMPLATE], num_token_texts=64)


def test_a_frontend_loads_its_tokenizer_and_renders_chats_without_torch_or_transformers(chat_folder):
    code = f"""
import sys
from pagedserve.frontend import server
from pagedserve.frontend.tokenization.chat_template import ChatTemplate
from pagedserve.frontend.tokenization.tokenizer import load_tokenizer
tokenizer = load_tokenizer({str(chat_folder)!r})
ids = ChatTemplate(tokenizer).encode([{{"role": "user", "content": "hi"}}])
assert ids and tokenizer.decode(tokenizer.encode("hi there")) == "hi there", ids
print(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "transformers")))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
