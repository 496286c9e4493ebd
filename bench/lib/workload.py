"""The benchmark model and workloads, shared by every script in bench/.

The model is Llama-shaped with seeded weights (pagedserve.checkpoints.tiny_checkpoint), built once into
bench/results/models/ and reused:

    hidden 768, 8 layers, 12 query heads / 2 KV heads of 64, MLP 2048, vocabulary 8192 (tied)
    -> 55.1M parameters: 48.8M in the decoder layers, 6.3M in the embedding (also the LM head)

Requests carry token ids (the frontend still detokenizes what it streams back); prompt and
output lengths are drawn uniformly from a seeded generator, sampling is greedy and EOS is
ignored, so every system produces exactly the requested number of tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from lib.output import RESULTS_DIR

BENCH_DIR = Path(__file__).resolve().parent.parent
MODELS_DIR = RESULTS_DIR / "models"


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden_size: int = 768
    num_layers: int = 8
    num_heads: int = 12
    num_kv_heads: int = 2
    intermediate_size: int = 2048
    vocab_size: int = 8192
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def name(self) -> str:
        return (f"llama-h{self.hidden_size}-l{self.num_layers}-a{self.num_heads}-kv{self.num_kv_heads}"
                f"-i{self.intermediate_size}-v{self.vocab_size}")

    @property
    def num_layer_params(self) -> int:
        """Weights of the matrix multiplies in one decoder layer (norm weights left out)."""
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        attention = self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
        return attention + 3 * self.hidden_size * self.intermediate_size

    @property
    def num_params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        norms = (2 * self.num_layers + 1) * self.hidden_size
        return self.num_layers * self.num_layer_params + embeddings + norms

    def flops_per_token(self, context_len: int, *, is_logits_row: bool = True) -> float:
        """Model FLOPs of one token at position context_len - 1: 2 per weight of every matrix
        multiply it goes through (the LM head only for a row that samples) plus attention
        (QK^T and PV: 4 x context x query width per layer). The embedding lookup is no FLOP."""
        matmul = self.num_layers * self.num_layer_params
        if is_logits_row:
            matmul += self.vocab_size * self.hidden_size
        attention = 4 * self.num_layers * context_len * self.num_heads * self.head_size
        return 2.0 * matmul + attention


BENCH_MODEL = ModelShape()


def build_model(shape: ModelShape = BENCH_MODEL, dtype: str = "float32") -> Path:
    """The checkpoint folder (config, safetensors, tokenizer) for shape and dtype; built on first use."""
    from pagedserve.checkpoints.tiny_checkpoint import build_tiny_checkpoint
    from pagedserve.checkpoints.tiny_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tokenizer

    folder = MODELS_DIR / f"{shape.name}-{dtype}"
    marker = folder / "bench_model.json"
    if marker.is_file() and json.loads(marker.read_text()) == asdict(shape):
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder, vocab_size=shape.vocab_size)
    build_tiny_checkpoint(folder, architecture="llama", vocab_size=shape.vocab_size,
                          hidden_size=shape.hidden_size, num_layers=shape.num_layers,
                          num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                          intermediate_size=shape.intermediate_size,
                          max_position_embeddings=shape.max_position_embeddings,
                          tie_word_embeddings=shape.tie_word_embeddings, seed=0,
                          bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, dtype=dtype)
    marker.write_text(json.dumps(asdict(shape)))
    return folder


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def make_requests(num_requests: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int],
                  *, vocab_size: int = BENCH_MODEL.vocab_size, seed: int = 0) -> list[BenchRequest]:
    """num_requests prompts of random ids (special ids 0-3 avoided) with uniform lengths in the
    inclusive ranges given."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = rng.randint(*prompt_lens)
        prompt = [rng.randrange(4, vocab_size) for _ in range(prompt_len)]
        requests.append(BenchRequest(prompt, rng.randint(*output_lens)))
    return requests
