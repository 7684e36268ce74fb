"""A float32 GGUF file of a tiny transformers model, written with the ``gguf`` library (no download).

llama.cpp runs it with the same weights as the torch model: what the llama.cpp tests need to
check ``LlamaCppModel`` itself (every position of a batch against single steps, the rollback,
greedy decoding against llama.cpp's own), in float32 and in a second.

The tensor names and metadata keys follow llama.cpp's ``convert_hf_to_gguf.py`` for the
``llama`` and ``qwen2`` architectures; like it, the ``llama`` architecture's q and k projections
are permuted from transformers' half-split rotary layout to llama.cpp's interleaved one
(``qwen2`` runs llama.cpp's NeoX rotary, the half-split layout, unpermuted). The vocabulary is
the tiny word-level tokenizer's token strings, declared as a SentencePiece ("llama") vocabulary,
which llama.cpp loads without merges or byte tokens; its ids are fed directly, never tokenized
by llama.cpp.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

_LAYER_TENSORS = {  # transformers' name in model.layers.N -> llama.cpp's in blk.N
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute``: half-split rotary rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(model: torch.nn.Module, tokenizer, path: str | Path) -> Path:
    """Write ``model`` (a tiny ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``) and its tokenizer as float32 GGUF.

    Returns:
        ``path``.

    Raises:
        ValueError: Another architecture (only llama and qwen2 are mapped).
    """
    config = model.config
    arch = config.model_type
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"write_tiny_gguf maps llama and qwen2 models, not {arch!r}")
    path = Path(path)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens = tokenizer.convert_ids_to_tokens(list(range(config.vocab_size)))
    special = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)

    state = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(config.num_hidden_layers):
        for hf, name in _LAYER_TENSORS.items():
            w = state.get(f"model.layers.{i}.{hf}")
            if w is None:
                continue
            if arch == "llama" and hf.startswith("self_attn.q_proj."):
                w = _permute(w, n_head)
            elif arch == "llama" and hf.startswith("self_attn.k_proj."):
                w = _permute(w, n_kv)
            writer.add_tensor(f"blk.{i}.{name}", np.ascontiguousarray(w))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
