"""Random-weight models for SGLang's other KV pools, made on the spot (nothing is downloaded: the lent GPU
machine has no network).

- ``make_tiny_mla``: a DeepSeek-V2-Lite-shaped ``DeepseekV2ForCausalLM``: Lite's attention geometry (16 heads,
  ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, ``qk_nope_head_dim`` 128, ``v_head_dim`` 128, no
  ``q_lora_rank``), so SGLang keeps MLA latents in ``MLATokenToKVPool`` (576 values a token and layer), with
  4 layers, small hidden and MLP sizes and dense MLPs only (no MoE kernels).
- ``make_tiny_hybrid_mamba``: a ``FalconH1ForCausalLM``, whose every layer runs attention and a Mamba2 mixer
  side by side: SGLang's ``mamba2_config`` is set for it, so requests live in ``HybridReqToTokenPool`` with
  their Mamba states in ``MambaPool`` and K/V in an MHA pool inside ``HybridLinearKVPool``. Falcon-H1 rather
  than NemotronH (SGLang refuses the triton attention backend for it) or Qwen3-Next (MoE in every SGLang
  layer): its MLPs are dense and its Mamba2 layers run on SGLang's triton kernels and sgl-kernel's conv1d.

Both are bfloat16 with the tokenizer of ``examples/01_two_engines/tiny_model.py`` (371 tokens), 8192
positions, and weigh 52 MB and 32 MB at 4 layers. Serve them with ``--attention-backend triton``; no remote code.
"""

from __future__ import annotations

import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _tiny_model() -> Any:
    """``examples/01_two_engines/tiny_model.py``: its tokenizer and its crash-safe ``save_model``."""
    examples = os.path.join(REPO, "examples", "01_two_engines")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import tiny_model

    return tiny_model


def make_tiny_mla(path: str, seed: int = 0, *, layers: int = 4) -> str:
    """Write the DeepSeek-V2-Lite-shaped MLA model and tokenizer to ``path`` (once) and return it."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    tokenizer = _tiny_model().make_tokenizer()
    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=layers,
        # DeepSeek-V2-Lite's attention: what sizes SGLang's MLA pool and kernels.
        num_attention_heads=16,
        num_key_value_heads=16,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        # Lite's MoE settings stay (SGLang reads them even for dense layers), but no layer reaches
        # first_k_dense_replace: every MLP is dense, so neither the checkpoint nor SGLang has experts.
        first_k_dense_replace=layers,
        moe_layer_freq=1,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        moe_intermediate_size=256,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        max_position_embeddings=8192,  # Lite's YaRN scaling left out: plain RoPE up to here
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="bfloat16",
    )
    model = DeepseekV2ForCausalLM(config).to(torch.bfloat16)
    return _tiny_model().save_model(model, tokenizer, path)


def make_tiny_hybrid_mamba(path: str, seed: int = 0, *, layers: int = 4) -> str:
    """Write the Falcon-H1 hybrid (attention and Mamba2 in every layer) and tokenizer to ``path`` (once) and
    return it."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import FalconH1Config, FalconH1ForCausalLM

    tokenizer = _tiny_model().make_tokenizer()
    torch.manual_seed(seed)
    config = FalconH1Config(
        vocab_size=len(tokenizer),
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        # Mamba2 mixer: 16 heads of 64 with a 128-wide state, one group: 2 MiB of fp32 state a request.
        mamba_d_ssm=1024,
        mamba_n_heads=16,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=128,
        mamba_d_conv=4,
        mamba_chunk_size=256,
        mamba_rms_norm=False,
        max_position_embeddings=8192,
        pad_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype="bfloat16",
    )
    # The mixer asks transformers for Hub kernels (causal-conv1d, mamba-ssm) when it is built; where the
    # `kernels` package is installed that is a download (USE_HUB_KERNELS does not stop it), and the GPU
    # machine has no network. Only the weights are wanted here: build without kernels.
    from transformers.models.falcon_h1 import modeling_falcon_h1

    lookup = modeling_falcon_h1.lazy_load_kernel
    modeling_falcon_h1.lazy_load_kernel = lambda _name: None
    try:
        model = FalconH1ForCausalLM(config).to(torch.bfloat16)
    finally:
        modeling_falcon_h1.lazy_load_kernel = lookup
    return _tiny_model().save_model(model, tokenizer, path)
