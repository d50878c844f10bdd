"""A standard Hugging Face causal LM built from the guide's architecture settings.

Learned positions give GPT-2's architecture (LayerNorm, GELU/ReLU/SiLU MLP, biases); rotary
positions give Llama's (RMSNorm, SwiGLU MLP, optional biases). Either saves with
`save_pretrained`, loads with `AutoModelForCausalLM`, generates, and fine-tunes with
`tunebench train --model DIR`.
"""

from __future__ import annotations

import hashlib
import json

import torch

from tunebench.core.errors import TunebenchError
from tunebench.settings.pretrain import ModelConfig

# GPT-2's own gelu is the tanh form. "gelu_pytorch_tanh" is that function as one fused torch kernel; "gelu_new"
# computes it in five elementwise ops (and ten backward), measured 1.4x slower for a whole step of the
# 4 x 128 shakespeare_char model at micro batch 64 on a 2-core CPU. gelu_exact is the erf form (torch's
# nn.GELU(), nanoGPT's MLP; transformers calls it "gelu"): on an AVX2 CPU its kernels took 0.6 ms forward +
# backward for a 768 x 512 tensor against 1.6 for the tanh form, whose vectorised tanh is the slow part.
GPT2_ACTIVATION = {"gelu": "gelu_pytorch_tanh", "gelu_exact": "gelu", "relu": "relu", "swish": "silu"}


def hf_config(m: ModelConfig, tokenizer):
    """The transformers config for `m`, with the tokenizer's special token ids."""
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    if m.use_learned_pos_emb:
        from transformers import GPT2Config

        return GPT2Config(vocab_size=m.vocab_size, n_positions=m.max_seq_len, n_embd=m.d_model, n_layer=m.n_layers,
                          n_head=m.n_heads, n_inner=m.d_ff, activation_function=GPT2_ACTIVATION[m.activation],
                          resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.attention_dropout,
                          layer_norm_epsilon=m.layer_norm_eps, initializer_range=m.init_std,
                          tie_word_embeddings=m.tie_embeddings, use_cache=False, **ids)
    from transformers import LlamaConfig

    if m.dropout:
        raise TunebenchError("model.dropout: Llama-style layers have no residual dropout (only attention_dropout); "
                             "set dropout: 0")
    return LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
                       num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
                       max_position_embeddings=m.max_seq_len, hidden_act="silu", rms_norm_eps=m.layer_norm_eps,
                       initializer_range=m.init_std, tie_word_embeddings=m.tie_embeddings,
                       attention_dropout=m.attention_dropout, attention_bias=m.use_bias, mlp_bias=m.use_bias,
                       use_cache=False, **ids)


def check_vocab(m: ModelConfig, tokenizer) -> None:
    if len(tokenizer) > m.vocab_size:
        raise TunebenchError(f"model.vocab_size {m.vocab_size} is smaller than the tokenizer's {len(tokenizer)} "
                             f"tokens; set model.vocab_size to at least {len(tokenizer)}")


def build(m: ModelConfig, tokenizer, seed: int):
    """The model, initialised from `seed` without touching the run's RNG."""
    from transformers import AutoModelForCausalLM

    check_vocab(m, tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(m, tokenizer))
    model.train()
    return model


def fingerprint(m: ModelConfig) -> str:
    """The architecture's key for measurements on record: its settings, and the layer code they map to
    (so a faster activation kernel is measured afresh, not read from a cache of the slower one)."""
    built = {**m.__dict__, "gpt2_activation": GPT2_ACTIVATION.get(m.activation) if m.use_learned_pos_emb else None}
    return hashlib.sha256(json.dumps(built, sort_keys=True).encode()).hexdigest()[:12]
