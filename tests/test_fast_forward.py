"""The forward's speed devices change nothing but speed: fused projections, RoPE tables, packed tokens.

Fused q/k/v and gate/up weights are views that the layers' own parameters point into, so checkpoints
keep Hugging Face names, training and adapters still see the layers, and a replaced parameter is
noticed. Packing (`real`) computes only the real tokens of a padded batch and must give their logits.
"""

import pytest
import torch
import transformers

from refusion.model.checkpoint import load_model, save_model
from refusion.model.config import ModelConfig
from refusion.model.transformer import Transformer, apply_rope, rope_inv_freq

CFG = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
           mask_token_id=49, eos_token_id=1)


def model(**kw) -> Transformer:
    return Transformer(ModelConfig(**{**CFG, **kw})).init_weights(seed=0, std=0.3).eval()


def logits(m, ids=((3, 4, 5, 6),)):
    ids = torch.tensor(ids)
    with torch.inference_mode():
        return m(ids, torch.arange(ids.shape[1]).expand_as(ids))


def test_fused_weights_are_the_layers_own_storage():
    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    logits(m)  # the first inference forward stacks the weights
    w = m._inference_weights()[0]
    attn, mlp = m.layers[0].self_attn, m.layers[0].mlp
    assert attn.q_proj.weight.data_ptr() == w.qkv.data_ptr()
    assert attn.v_proj.weight.data_ptr() == w.qkv[-attn.v_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == w.gate_up[-mlp.up_proj.out_features:].data_ptr()
    # same names, same values; nothing else in the state dict
    after = m.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_inference_path_equals_the_modules():
    """Without gradients the blocks run as one function over stacked weights; with them, as modules."""
    m = model(qkv_bias=True)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    pos = torch.tensor([[0, 2, 1, 3], [5, 4, 7, 6]])
    with torch.inference_mode():
        fast = m(ids, pos)
    slow = m(ids, pos).detach()  # grad mode: the modules
    assert m._inference_weights() is not None
    torch.testing.assert_close(fast, slow, atol=0, rtol=0)


def test_save_writes_plain_names_that_transformers_reads(tmp_path):
    m = model()
    want = logits(m)
    save_model(m, tmp_path / "ck")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    names = set(hf.state_dict())
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight"} <= names
    assert not any("qkv" in n or "gate_up" in n for n in names)
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids, position_ids=torch.arange(4)[None]).logits, want,
                                   atol=1e-5, rtol=0)
    torch.testing.assert_close(logits(load_model(tmp_path / "ck")), want, atol=0, rtol=0)


def test_updates_of_a_part_reach_the_fused_product():
    m = model()
    logits(m)
    with torch.no_grad():  # in place, as an optimizer step or load_state_dict does
        m.layers[1].self_attn.k_proj.weight.mul_(-1.5)
        m.layers[1].mlp.up_proj.weight.add_(0.1)
    fresh = Transformer(m.config).eval()
    fresh.load_state_dict(m.state_dict())  # separate, unfused copies of the same values
    torch.testing.assert_close(logits(m), logits(fresh), atol=1e-6, rtol=0)


def test_a_replaced_parameter_is_noticed():
    m = model()
    logits(m)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    sd["layers.0.self_attn.q_proj.weight"] = torch.randn_like(sd["layers.0.self_attn.q_proj.weight"])
    m.load_state_dict(sd, assign=True)  # new storage for every parameter
    fresh = Transformer(m.config).eval()
    fresh.load_state_dict(sd)
    torch.testing.assert_close(logits(m), logits(fresh), atol=1e-6, rtol=0)


def test_training_after_inference_trains_the_layers():
    m = model()
    logits(m)  # stacked and re-pointed
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    pos = torch.arange(5)[None]
    q0 = m.layers[0].self_attn.q_proj.weight.detach().clone()
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(m(ids[:, :-1], pos[:, :-1])[0], ids[0, 1:])
        opt.zero_grad()
        loss.backward()
        assert m.layers[0].self_attn.q_proj.weight.grad is not None
        opt.step()
    assert not torch.equal(m.layers[0].self_attn.q_proj.weight, q0)
    m.eval()
    fresh = Transformer(m.config).eval()
    fresh.load_state_dict(m.state_dict())
    torch.testing.assert_close(logits(m), logits(fresh), atol=1e-6, rtol=0)


def test_an_adapter_on_one_projection_is_not_bypassed():
    """A layer replaced by another module (as LoRA does) breaks the fusion: the layers run one by one."""
    m = model()
    base = logits(m)

    class Doubled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return 2 * self.inner(x)

    m.layers[0].self_attn.v_proj = Doubled(m.layers[0].self_attn.v_proj)
    assert not torch.allclose(logits(m), base)


def test_rope_from_the_table_is_the_textbook_rotation():
    m = model(rope_theta=1e6)
    inv = rope_inv_freq(m.config)
    pos = torch.tensor([0, 1, 7, 300])
    ang = pos[:, None].float() * inv
    ang = torch.cat([ang, ang], -1)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x = torch.randn(4, 3, m.config.head_dim, generator=torch.Generator().manual_seed(0))
    x1, x2 = x.chunk(2, -1)
    want = x * cos + torch.cat([-x2, x1], -1) * sin
    table = m.rope[pos]
    got = apply_rope(x, table[:, :1], table[:, 1:])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(table[:, 0, None], cos, atol=0, rtol=0)


@pytest.mark.parametrize("num_logits", [None, 2])
def test_packed_tokens_give_the_padded_batch_logits(num_logits):
    m = model()
    B, T, widths = 3, 6, [3, 6, 1]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49, (B, T), generator=g)
    pos = torch.arange(T).repeat(B, 1) + 2
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, w in enumerate(widths):
        valid[b, T - w:] = True
    mask = (torch.ones(T, T, dtype=torch.bool).tril() & valid[:, None, None, :]) | torch.eye(T, dtype=torch.bool)
    real = valid.reshape(-1).nonzero().squeeze(1)
    cache_a, cache_b = m.new_cache(), m.new_cache()
    with torch.inference_mode():
        padded = m(ids, pos, attn_mask=mask, cache=cache_a, num_logits=num_logits)
        packed = m(ids, pos, attn_mask=mask, cache=cache_b, num_logits=num_logits, real=real)
        # a second step on top of the caches: the packed run's padding keys hold zeros, still masked
        nxt = torch.randint(0, 49, (B, 1), generator=g)
        keys = torch.cat([valid, torch.ones(B, 1, dtype=torch.bool)], 1)[:, None, None, :]
        step_a = m(nxt, pos[:, -1:] + 1, attn_mask=keys, cache=cache_a)
        step_b = m(nxt, pos[:, -1:] + 1, attn_mask=keys, cache=cache_b)
    need = valid[:, -packed.shape[1]:]
    torch.testing.assert_close(packed[need], padded[need], atol=1e-5, rtol=0)
    assert packed[~need].abs().max() == 0
    torch.testing.assert_close(step_b, step_a, atol=1e-5, rtol=0)
