"""A tiny random llama GGUF shaped like SmolLM2's file: a byte-level BPE vocabulary that encodes any
text (256 byte tokens and ChatML's special tokens, no merges), a ChatML chat template, tied
embeddings. The stand-in for `refusion import-gguf smollm2` where nothing may be downloaded."""

import gguf
import numpy as np
from tokenizers import pre_tokenizers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPE = dict(hidden=32, ffn=64, layers=2, heads=4, kv_heads=2, context=4096)


def write_byte_level_gguf(path, seed: int = 0, std: float = 0.5) -> None:
    tokens = SPECIAL + sorted(pre_tokenizers.ByteLevel.alphabet())
    c = SHAPE
    d, head_dim = c["hidden"], c["hidden"] // c["heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c["layers"])
    w.add_context_length(c["context"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)

    def add(name: str, *shape: int) -> None:  # HF's [out, in] layout, as llama.cpp stores it
        w.add_tensor(name, (rng.standard_normal(shape) * std).astype(np.float32))

    add("token_embd.weight", len(tokens), d)  # no output.weight: tied embeddings
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    kv = c["kv_heads"] * head_dim
    for i in range(c["layers"]):
        add(f"blk.{i}.attn_q.weight", d, d)
        add(f"blk.{i}.attn_k.weight", kv, d)
        add(f"blk.{i}.attn_v.weight", kv, d)
        add(f"blk.{i}.attn_output.weight", d, d)
        add(f"blk.{i}.ffn_gate.weight", c["ffn"], d)
        add(f"blk.{i}.ffn_up.weight", c["ffn"], d)
        add(f"blk.{i}.ffn_down.weight", d, c["ffn"])
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
