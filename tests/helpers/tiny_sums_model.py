"""A tiny random model with a BPE tokenizer trained on sums: for the evaluation tests' mechanics."""

import torch

from refusion.model.config import ModelConfig
from refusion.model.tokenizer import Tokenizer
from refusion.model.transformer import Transformer
from refusion.training.data import train_bpe_tokenizer


def tiny_sums_model() -> tuple[Transformer, Tokenizer]:
    torch.manual_seed(0)
    tok = train_bpe_tokenizer([f"what is {i} plus {i + 1}? {2 * i + 1}" for i in range(50)], vocab_size=280)
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, mask_token_id=tok.mask_id)
    return Transformer(cfg).init_weights(seed=0).eval(), tok
