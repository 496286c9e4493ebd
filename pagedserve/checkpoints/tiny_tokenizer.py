"""A tiny deterministic byte-level BPE tokenizer for tests and `--model demo` (no model hub needed).

`build_tokenizer(folder)` trains a byte-level BPE with the `tokenizers` library on the English text
embedded below and saves it as a Hugging Face tokenizer folder:

```
folder/tokenizer.json            the trained model, byte-level pre-tokenizer and decoder, BOS template
folder/tokenizer_config.json     tokenizer class, special tokens, add_bos_token / add_eos_token
folder/special_tokens_map.json
```

so `transformers.AutoTokenizer.from_pretrained(folder)` loads it. The ids are fixed:

```
0 <unk>   1 <s> (BOS)   2 </s> (EOS)   3 <pad>   4 .. 259 the 256 bytes   260 .. merges
```

Encoding adds BOS in front (as Llama tokenizers do). The vocabulary has exactly `vocab_size`
entries: merges learnt from the text, then `<|reserved_k|>` special tokens if the text runs out of
merges, so a model checkpoint can be given the same `vocab_size`. Training is deterministic: the
same `vocab_size` gives byte-identical files.
"""

from __future__ import annotations

import json
from pathlib import Path

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
UNK_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
PAD_TOKEN_ID = 3
NUM_BYTE_TOKENS = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + NUM_BYTE_TOKENS
DEFAULT_VOCAB_SIZE = 512
MAX_VOCAB_SIZE = 65536
MODEL_MAX_LENGTH = 4096

TRAINING_TEXT = """\
The old lighthouse stood at the edge of the harbour, and every evening the keeper climbed the
narrow stairs to light the lamp. Ships that passed in the night saw the beam sweep across the
water, and the sailors knew that they were close to home. In the morning the fishermen went out
before the sun rose, and by noon the market was full of voices, baskets and the smell of the sea.

A language model reads a sequence of tokens and predicts the next one. The tokens are pieces of
words: common words become a single token, while rare words are split into several smaller
pieces. A tokenizer that works on bytes can represent any text at all, even words it has never
seen, because every character is made of one or more bytes. Numbers such as 12, 256, 1024 and
2048 appear often in technical writing, and so do symbols like +, -, = and %.

Memory is the scarce resource when a server answers many requests at once. Each request keeps a
cache of keys and values for every token it has seen, and that cache grows as the answer grows.
Splitting the cache into small blocks of equal size lets the server place them anywhere, share
them between requests that begin with the same words, and move them out when memory runs short.
The scheduler decides which requests run in each step, and the workers run the model.

She ordered a café au lait and a croissant, paid three euros (3 €) and sat by the window with a
naïve smile. Über den Wolken, the song said, freedom must be boundless. The résumé listed Zürich,
São Paulo and Kraków; the price was 5 £ or about ¥ 900. Quotes “like these” and dashes — like this
one — are common in printed books, and some writers end a note with a small star ★ or a heart ♥.

Why do we test software? Because every change can break something that used to work. A good test
is small, fast and precise: it sets up a situation, runs the code and checks the result. When a
test fails, it should say clearly what was expected and what happened instead. Tests that pass
when the code is wrong are worse than no tests at all, because they give a false sense of safety.
"""


def build_tokenizer(folder: str | Path, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Trains the tiny tokenizer and writes it into `folder` (created if missing); returns the folder.

    BOS is `BOS_TOKEN_ID`, EOS is `EOS_TOKEN_ID`; the saved vocabulary has exactly `vocab_size`
    entries. Raises ValueError when `vocab_size` is outside [MIN_VOCAB_SIZE, MAX_VOCAB_SIZE].
    """
    if not MIN_VOCAB_SIZE <= vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}], got {vocab_size}")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    num_missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if num_missing > 0:
        tokenizer.add_special_tokens(
            [AddedToken(f"<|reserved_{k}|>", special=True, normalized=False) for k in range(num_missing)]
        )
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
            special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
        ),
    ])
    _check_special_ids(tokenizer)

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(_special_tokens_map(), indent=2) + "\n")
    return out


def _check_special_ids(tokenizer) -> None:
    expected = {UNK_TOKEN: UNK_TOKEN_ID, BOS_TOKEN: BOS_TOKEN_ID, EOS_TOKEN: EOS_TOKEN_ID, PAD_TOKEN: PAD_TOKEN_ID}
    for token, token_id in expected.items():
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"tokenizer training put {token} at id {tokenizer.token_to_id(token)}, not {token_id}")


def _special_tokens_map() -> dict[str, str]:
    return {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "unk_token": UNK_TOKEN, "pad_token": PAD_TOKEN}


def _tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        **_special_tokens_map(),
    }
