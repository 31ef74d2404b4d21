"""Parity of refusion's Transformer with transformers' own classes on the same weights."""

from itertools import pairwise

import pytest
import torch
import transformers

from refusion.model.checkpoint import load_model, save_model
from refusion.model.config import ModelConfig
from refusion.model.transformer import Transformer

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

ARCHS = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24, rope_theta=1e6)),
    "qwen3-bias-untied": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                          dict(attention_bias=True, tie_word_embeddings=False)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_theta=5e5, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                          high_freq_factor=4.0, original_max_position_embeddings=64))),
    "llama-linear-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        rope_scaling=dict(rope_type="linear", factor=2.0))),
}


def _pair(name, tmp_path):
    cfg_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**TINY, **extra)).eval()
    with torch.no_grad():  # random biases and norm weights, so a dropped one is noticed
        for n, p in hf.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.normal_(0, 0.5).add_(1.0 if "norm" in n else 0.0)
    hf.save_pretrained(tmp_path)
    return hf, load_model(tmp_path)


def _positions(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(T, generator=g) + 3 for _ in range(B)])


@pytest.mark.parametrize("name", list(ARCHS))
def test_logits_match_transformers_with_shuffled_positions(name, tmp_path):
    hf, ours = _pair(name, tmp_path)
    B, T = 2, 11
    ids = torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(2))
    pos = _positions(B, T)
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        got = ours(ids, pos)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "llama3-rope"])
def test_logits_match_transformers_with_kv_cache(name, tmp_path):
    hf, ours = _pair(name, tmp_path)
    T = 13
    ids = torch.randint(0, TINY["vocab_size"], (1, T), generator=torch.Generator().manual_seed(3))
    pos = _positions(1, T)
    cut = [0, 6, 7, 13]  # prefill 6, one token, then 6 at once
    cache = ours.new_cache()
    hf_cache = transformers.DynamicCache(config=hf.config)
    with torch.no_grad():
        for a, b in pairwise(cut):
            ref = hf(input_ids=ids[:, a:b], position_ids=pos[:, a:b], past_key_values=hf_cache, use_cache=True).logits
            got = ours(ids[:, a:b], pos[:, a:b], cache=cache)
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
        full = ours(ids, pos)
    assert len(cache) == T
    torch.testing.assert_close(got, full[:, 7:], atol=1e-5, rtol=0)


def test_custom_mask_equals_separate_rows():
    """A block mask over one packed row gives what two independent rows give (the infill trick)."""
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2,
                                num_heads=4, num_kv_heads=2)).init_weights(seed=0).eval()
    prefix, a, b = torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]]), torch.tensor([[6, 7]])
    pa, pb = torch.tensor([[3, 4]]), torch.tensor([[9, 10]])
    with torch.no_grad():
        ra = m(torch.cat([prefix, a], 1), torch.cat([torch.arange(3)[None], pa], 1))[:, 3:]
        rb = m(torch.cat([prefix, b], 1), torch.cat([torch.arange(3)[None], pb], 1))[:, 3:]
        mask = torch.ones(7, 7, dtype=torch.bool).tril()
        mask[5:, 3:5] = False  # b's tokens do not see a's
        packed = m(torch.cat([prefix, a, b], 1), torch.cat([torch.arange(3)[None], pa, pb], 1), attn_mask=mask)
    torch.testing.assert_close(packed[:, 3:5], ra, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed[:, 5:7], rb, atol=1e-5, rtol=0)


def test_position_ids_not_feed_order_matter():
    """Same tokens and positions fed in another order give other logits (causal in feed order)."""
    m = Transformer(ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                                num_heads=2, num_kv_heads=1)).init_weights(seed=1).eval()
    ids, pos = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]])
    with torch.no_grad():
        a = m(ids, pos)
        b = m(ids[:, [2, 0, 1]], pos[:, [2, 0, 1]])
    # the first fed token sees only itself: its logits equal a single-token forward
    with torch.no_grad():
        alone = m(ids[:, 2:], pos[:, 2:])
    torch.testing.assert_close(b[:, 0], alone[:, 0], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 2], b[:, 0], atol=1e-4)


def test_save_load_roundtrip_and_transformers_reads_it(tmp_path):
    cfg = ModelConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, mask_token_id=59, eos_token_id=1)
    m = Transformer(cfg).init_weights(seed=0).eval()
    save_model(m, tmp_path / "ck", max_shard_bytes=20_000)  # forces several shards + index
    assert (tmp_path / "ck" / "model.safetensors.index.json").exists()
    back = load_model(tmp_path / "ck")
    assert back.config.mask_token_id == 59
    ids = torch.tensor([[3, 4, 5, 6]])
    pos = torch.tensor([[0, 1, 2, 3]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids, pos), m(ids, pos), atol=0, rtol=0)
        torch.testing.assert_close(hf(input_ids=ids, position_ids=pos).logits, m(ids, pos), atol=1e-5, rtol=0)
