"""Small Hugging Face models made from a shape: the ``build`` source's random models and the
attention-only models the pipeline trains (``compatlas.models.training``).

Both name a model by the same few sizes (layers, heads, head width, vocabulary, context); this
module alone maps them onto ``GPT2Config`` / ``LlamaConfig``. What differs between the two
users (dropout, special token ids, tied embeddings) is passed through as the HF config's own
keywords. Neither has a pretrained tokenizer, so ``word_tokenizer`` saves one beside the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from compatlas.vocab import ARCHITECTURES, Architecture


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a small model. ``n_kv_heads`` (Llama's grouped-query attention) defaults to
    ``n_heads``; ``d_mlp`` to each architecture's 4 x d_model."""

    architecture: Architecture
    n_layers: int
    n_heads: int
    d_head: int
    d_vocab: int
    n_ctx: int = 256
    n_kv_heads: int | None = None
    d_mlp: int | None = None

    @property
    def d_model(self) -> int:
        return self.n_heads * self.d_head


def small_hf_model(shape: ModelShape, seed: int, **hf_config: Any):
    """A randomly initialised ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` of ``shape``, its
    weights drawn after ``torch.manual_seed(seed)``; ``hf_config`` goes to the HF config as is."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if shape.architecture == "gpt2":
        gpt2 = GPT2Config(n_layer=shape.n_layers, n_head=shape.n_heads, n_embd=shape.d_model, vocab_size=shape.d_vocab,
                          n_positions=shape.n_ctx, n_inner=shape.d_mlp, **hf_config)
        return GPT2LMHeadModel(gpt2)
    if shape.architecture == "llama":
        llama = LlamaConfig(num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads,
                            num_key_value_heads=shape.n_kv_heads or shape.n_heads, hidden_size=shape.d_model,
                            head_dim=shape.d_head, intermediate_size=shape.d_mlp or 4 * shape.d_model,
                            vocab_size=shape.d_vocab, max_position_embeddings=shape.n_ctx, **hf_config)
        return LlamaForCausalLM(llama)
    raise ValueError(f"unknown architecture {shape.architecture!r}; choose from {ARCHITECTURES}")


def word_tokenizer(vocab_size: int, folder: Path):
    """An offline word-level tokenizer (tokens ``t0`` .. ``t{n-1}``, ``t0`` also BOS and EOS)
    saved into ``folder``. The bridge needs a tokenizer, and reloading it from disk gives it the
    ``name_or_path`` the bridge asks for."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t0", eos_token="t0").save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)
