"""The one forward and what makes it fast change nothing but speed: fused projections, RoPE tables,
packed tokens, a block run as one module call.

q/k/v and gate/up are one Linear each inside the model and separate Hugging Face tensors on disk
(checkpoint.to_hf / from_hf); LoRA still adapts the projections users name; adapters and hooks on a
projection are run, not bypassed; training and inference are the same arithmetic.
"""

import pytest
import torch
import transformers

from refusion.model.checkpoint import from_hf, load_model, save_model, to_hf
from refusion.model.config import ModelConfig
from refusion.model.lora import apply_lora, merged_state_dict
from refusion.model.transformer import STREAMED_BYTES, Transformer, apply_rope, linear, rope_inv_freq

CFG = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
           mask_token_id=49, eos_token_id=1)


def model(**kw) -> Transformer:
    return Transformer(ModelConfig(**{**CFG, **kw})).init_weights(seed=0, std=0.3).eval()


def logits(m, ids=((3, 4, 5, 6),)):
    ids = torch.tensor(ids)
    with torch.inference_mode():
        return m(ids, torch.arange(ids.shape[1]).expand_as(ids))


@pytest.mark.parametrize("kw", [dict(), dict(qkv_bias=True, qk_norm=False, tie_word_embeddings=False)])
def test_hugging_face_names_map_both_ways(kw):
    m = model(**kw)
    sd = m.state_dict()
    assert "layers.0.self_attn.qkv_proj.weight" in sd and "layers.0.mlp.gate_up_proj.weight" in sd
    hf = to_hf(sd, m.config)
    q, kv, up = 4 * 8, 2 * 8, 48
    shapes = {"q_proj": (q, 32), "k_proj": (kv, 32), "v_proj": (kv, 32), "gate_proj": (up, 32), "up_proj": (up, 32)}
    for name, shape in shapes.items():
        part = "self_attn" if name[0] in "qkv" else "mlp"
        assert hf[f"model.layers.1.{part}.{name}.weight"].shape == shape
    if kw.get("qkv_bias"):
        assert hf["model.layers.0.self_attn.k_proj.bias"].shape == (kv,)
    assert not any("qkv" in n or "gate_up" in n for n in hf)
    # rows q, k, v: the k part is the middle block of the fused weight
    assert torch.equal(hf["model.layers.0.self_attn.k_proj.weight"], sd["layers.0.self_attn.qkv_proj.weight"][q: q + kv])
    back = from_hf(hf, m.config)
    assert list(back) == list(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_a_seed_gives_the_weights_separate_layers_would_get():
    """init_weights draws a fused projection's parts one by one, in Hugging Face order: a seed means
    the same model as before the projections were fused."""
    m = model()
    gen = torch.Generator().manual_seed(0)
    for name, t in to_hf(m.state_dict(), m.config).items():
        if name == "lm_head.weight":  # tied to the embedding
            continue
        if name.endswith("norm.weight"):
            assert t.eq(1).all()
        else:
            assert torch.equal(t, torch.randn(t.shape, generator=gen) * 0.3), name


def test_save_writes_plain_names_that_transformers_reads(tmp_path):
    m = model()
    want = logits(m)
    save_model(m, tmp_path / "ck")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ck").eval()
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids, position_ids=torch.arange(4)[None]).logits, want,
                                   atol=1e-5, rtol=0)
    torch.testing.assert_close(logits(load_model(tmp_path / "ck")), want, atol=0, rtol=0)


def test_training_and_inference_are_the_same_arithmetic():
    m = model(qkv_bias=True)
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    pos = torch.tensor([[0, 2, 1, 3], [5, 4, 7, 6]])
    with torch.inference_mode():
        fast = m(ids, pos)
    m.train()
    slow = m(ids, pos)
    torch.testing.assert_close(fast, slow.detach(), atol=0, rtol=0)
    slow.square().mean().backward()
    assert m.layers[0].self_attn.qkv_proj.weight.grad.abs().sum() > 0
    assert m.layers[0].self_attn.q_norm.weight.grad.abs().sum() > 0
    m.gradient_checkpointing = True
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m(ids, pos).square().mean().backward()  # recomputed blocks: the same gradients
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], atol=0, rtol=0, msg=n)


def test_an_adapter_or_a_hook_on_a_projection_is_not_bypassed():
    m = model()
    base = logits(m)

    class Doubled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return 2 * self.inner(x)

    seen = []
    hook = m.layers[1].mlp.gate_up_proj.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    torch.testing.assert_close(logits(m), base, atol=0, rtol=0)
    assert seen == [(4, 2 * 48)]
    hook.remove()
    m.layers[0].self_attn.o_proj = Doubled(m.layers[0].self_attn.o_proj)
    assert not torch.allclose(logits(m), base)


def test_lora_on_q_adapts_q_alone_inside_the_fused_projection():
    m = model()
    base = logits(m)
    apply_lora(m, {"r": 2, "target_modules": ["q_proj"]})
    qkv = m.layers[0].self_attn.qkv_proj
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    q = 4 * 8
    with torch.no_grad():
        torch.testing.assert_close(qkv(x), qkv.base(x), atol=0, rtol=0)  # B starts at zero
        torch.testing.assert_close(logits(m), base, atol=0, rtol=0)
        for layer in m.layers:
            layer.self_attn.qkv_proj.lora_B["q_proj"].weight.normal_()
        y, y0 = qkv(x), qkv.base(x)
    assert torch.equal(y[:, q:], y0[:, q:])  # k and v exactly as they were
    assert not torch.allclose(y[:, :q], y0[:, :q])
    assert not torch.allclose(logits(m), base)
    hf, before = to_hf(merged_state_dict(m), m.config), to_hf(model().state_dict(), m.config)
    for name in ("k_proj", "v_proj"):
        assert torch.equal(hf[f"model.layers.0.self_attn.{name}.weight"], before[f"model.layers.0.self_attn.{name}.weight"])
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], before["model.layers.0.self_attn.q_proj.weight"])
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert trainable == {f"layers.{i}.self_attn.qkv_proj.lora_{ab}.q_proj.weight" for i in range(2) for ab in "AB"}


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["up_proj", "o_proj", "down_proj"]])
def test_merged_lora_weights_are_the_adapted_model(targets):
    m = model(qkv_bias=True)
    apply_lora(m, {"r": 4, "alpha": 8, "target_modules": targets})
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    plain = Transformer(m.config).eval()
    plain.load_state_dict(merged_state_dict(m))
    torch.testing.assert_close(logits(plain), logits(m), atol=1e-5, rtol=0)


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


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("in_features", [24, 1536])
@pytest.mark.parametrize("padded", [None, (1, 2, 3), (4, 4, 4), (2, 4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_product_is_f_linear_and_each_row_is_the_same_whatever_rows_are_beside_it(
        monkeypatch, bias, in_features, padded, dtype):
    """linear() on a streamed model's weight (oneDNN's packed layout): F.linear's values within the
    dtype's rounding for any rows (none, one, many, [B, T, in], a strided view), and in float32 each
    row's output the same bits whatever else is in the product: a verifying forward's logits at a
    position are what a one-token forward computes there: so whatever padding of few rows this
    machine's timing chose (padded_rows), and on the input width (1536) where some CPUs' one-row
    kernel rounds otherwise. (bfloat16 promises no such thing: its rows' last bits can depend on the
    rows beside them.)"""
    from refusion.model import packed

    if padded is not None:
        monkeypatch.setattr(packed, "padded_rows", lambda dtype=None: padded)
    monkeypatch.setattr(packed, "gemv_one_row", lambda dtype=None: False)
    monkeypatch.setattr(packed, "kernel_rows", lambda dtype=None: range(0))  # (the library paths: test_few_rows.py has the kernel)
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(in_features, 40, bias=bias).to(dtype)
    x = torch.randn(33, in_features, generator=g).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        for got_x in (x[:0], x[:1], x[:5], x, x.view(3, 11, -1), x.view(3, 11, -1)[:, 4:], x.view(3, 11, -1)[:, 4:5],
                      x.t().contiguous().t()):
            want = torch.nn.functional.linear(got_x.float(), lin.weight.float(),
                                              None if lin.bias is None else lin.bias.float())
            got = linear(lin, got_x, streamed=True)
            assert got.shape == want.shape and got.dtype == dtype
            torch.testing.assert_close(got.float(), want, **tol)
        assert "_onednn_weight" in lin.__dict__ and "_onednn_weight" not in lin.state_dict()
        whole = linear(lin, x, streamed=True)
        for n in (1, 2, 4, 5, 8, 16, 17) if dtype == torch.float32 else ():
            assert torch.equal(linear(lin, x[:n], streamed=True), whole[:n]), n
            assert torch.equal(linear(lin, x[n - 1:n], streamed=True)[0], whole[n - 1]), n


def test_a_streamed_product_under_autocast_or_on_rows_of_another_dtype_is_f_linear():
    """The packed path takes rows of the weight's own dtype outside autocast: under CPU autocast (a
    mask-only training with dtype = "bfloat16" runs the frozen base's forward so) or on bfloat16 rows
    for a float32 weight, linear() is F.linear, in the dtype autocast gives it. (oneDNN refused a
    bfloat16 row on a float32 packed weight.)"""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 40)
    x = torch.randn(5, 64, generator=g)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = torch.nn.functional.linear(x, lin.weight, lin.bias)
            got = linear(lin, x, streamed=True)
            assert got.dtype == want.dtype == torch.bfloat16
            assert torch.equal(got, want)
            got = linear(lin, x.bfloat16(), streamed=True)
            assert torch.equal(got, torch.nn.functional.linear(x.bfloat16(), lin.weight, lin.bias))
        lin16 = torch.nn.Linear(64, 40).to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(linear(lin16, x.bfloat16(), streamed=True),
                               torch.nn.functional.linear(x.bfloat16(), lin16.weight, lin16.bias))


def test_few_rows_run_as_the_count_timed_fastest_and_one_row_as_two_where_it_rounds_otherwise(monkeypatch):
    """rows_to_run by hand (pad to the fastest count from r up, only past the PAD_GAIN margin), and
    the rows a product of 1-3 rows hands oneDNN: as chosen, and never one row on a weight whose
    one-row product rounds otherwise than a row beside others (packed_weight's check)."""
    from refusion.model import packed

    assert packed.FEW_ROWS == 4 and packed.PAD_GAIN == 0.95
    assert packed.rows_to_run({1: 35.0, 2: 42.0, 3: 30.0, 4: 27.0}) == (4, 4, 4)
    assert packed.rows_to_run({1: 21.0, 2: 22.0, 3: 24.0, 4: 25.0}) == (1, 2, 3)
    assert packed.rows_to_run({1: 30.0, 2: 28.6, 3: 40.0, 4: 29.0}) == (1, 2, 4)  # 28.6 is not 5% under 30
    assert packed.rows_to_run({1: 30.0, 2: 28.4, 3: 40.0, 4: 29.0}) == (2, 2, 4)
    assert packed.onednn_packing()  # (this build has it; asked before _product is watched)
    monkeypatch.setattr(packed, "gemv_one_row", lambda dtype=None: False)
    monkeypatch.setattr(packed, "kernel_rows", lambda dtype=None: range(0))  # (the library paths: test_few_rows.py has the kernel)
    seen = []
    real = packed._product
    monkeypatch.setattr(packed, "_product", lambda x, w, b: seen.append(x.shape[0]) or real(x, w, b))
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(2, 3, 16)
    with torch.no_grad():
        for padded, differs, want in (((1, 2, 3), False, [1, 2, 3, 5]), ((4, 3, 3), False, [4, 3, 3, 5]),
                                      ((1, 2, 3), True, [2, 2, 3, 5]), ((3, 4, 3), True, [3, 4, 3, 5])):
            monkeypatch.setattr(packed, "padded_rows", lambda dtype=None: padded)
            monkeypatch.setattr(packed, "one_row_differs", lambda *_: differs)
            lin.__dict__.pop("_onednn_weight", None)
            seen.clear()
            for rows in (x[0, :1], x[0, :2], x[0], x.view(6, 16)[1:]):
                torch.testing.assert_close(linear(lin, rows, streamed=True), lin(rows), atol=1e-5, rtol=1e-5)
            assert seen == want, (padded, differs, seen)
            got = linear(lin, x[:, :1], streamed=True)  # [2, 1, 16]: two rows, shaped back
            assert got.shape == (2, 1, 8)


def test_one_row_takes_mkls_product_where_the_probe_timed_it_faster(monkeypatch):
    """gemv_one_row: a one-row product is F.linear's own, bit for bit, and packs nothing; two rows
    and more stay on the packed weight."""
    from refusion.model import packed

    monkeypatch.setattr(packed, "gemv_one_row", lambda dtype=None: True)
    monkeypatch.setattr(packed, "kernel_rows", lambda dtype=None: range(0))  # (the library paths: test_few_rows.py has the kernel)
    assert packed.onednn_packing()  # (this build has it; asked before _product is watched)
    calls = []
    real = packed._product
    monkeypatch.setattr(packed, "_product", lambda x, w, b: calls.append(x.shape[0]) or real(x, w, b))
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(96, 40)
    x = torch.randn(5, 96, generator=g)
    with torch.no_grad():
        for one in (x[:1], x[2:3].view(1, 1, 96)):
            assert torch.equal(linear(lin, one, streamed=True), torch.nn.functional.linear(one, lin.weight, lin.bias))
        assert calls == [] and "_onednn_weight" not in lin.__dict__
        torch.testing.assert_close(linear(lin, x, streamed=True), lin(x), atol=1e-5, rtol=1e-5)
    assert calls[-1] == 5  # (after the packing check's own products)


def test_the_probe_takes_gemv_where_it_beats_the_chosen_packed_product_by_the_margin():
    """choices(): padded counts as rows_to_run gives them, and gemv where it takes at most PAD_GAIN of
    the time of the packed product chosen for one row."""
    from refusion.model import packed

    more = {8: 50.0, 16: 60.0}
    assert packed.choices({1: 30.0, 2: 28.4, 3: 40.0, 4: 29.0, **more}, 20.0, {}) == ((2, 2, 4), True, range(0))
    assert packed.choices({1: 30.0, 2: 28.4, 3: 40.0, 4: 29.0, **more}, 27.0, {}) == ((2, 2, 4), False, range(0))
    assert packed.choices({1: 30.0, 2: 28.4, 3: 40.0, 4: 29.0, **more}, 26.9, {}) == ((2, 2, 4), True, range(0))
    assert packed.choices({1: 21.0, 2: 22.0, 3: 24.0, 4: 25.0, **more}, 40.0, {}) == ((1, 2, 3), False, range(0))


def test_the_probe_gives_the_kernel_the_counts_from_its_first_win_to_its_last_in_a_row():
    """choices(): the few-row kernel takes the counts from the first one timed at which it beats the
    best other path (gemv for one row where chosen, else the packed product as padded) to the last one
    from there at which it still does."""
    from refusion.model import packed

    lib = {1: 30.0, 2: 30.0, 3: 40.0, 4: 30.0, 8: 36.0, 16: 50.0}
    kernel = {1: 21.0, 2: 22.0, 4: 25.0, 8: 35.0, 16: 52.0}
    assert packed.choices(lib, 20.0, kernel).kernel_rows == range(2, 9)  # gemv's one row, 16 on the packed
    assert packed.choices(lib, 29.0, kernel).kernel_rows == range(1, 9)  # (29 is not 5% under 30: no gemv)
    assert packed.choices(lib, 29.0, {**kernel, 16: 49.0}).kernel_rows == range(1, 17)
    assert packed.choices(lib, 29.0, {**kernel, 2: 31.0}).kernel_rows == range(1, 2)  # wins after a loss: not taken
    assert packed.choices(lib, 29.0, {**kernel, 1: 31.0}).kernel_rows == range(2, 9)
    assert packed.choices(lib, 29.0, {r: 99.0 for r in kernel}).kernel_rows == range(0)


def test_a_packed_weight_follows_the_weight_and_autograd_takes_f_linear():
    """The packed copy is remade after the weight changes in place (an optimiser step, a load) or is
    replaced; with autograd on, the product is F.linear's, gradients and all."""
    lin = torch.nn.Linear(8, 6)
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = linear(lin, x, streamed=True)
        lin.weight.mul_(2)
        torch.testing.assert_close(linear(lin, x, streamed=True), lin(x), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(linear(lin, x, streamed=True), before)
    lin.weight = torch.nn.Parameter(torch.randn(6, 8))
    with torch.no_grad():
        torch.testing.assert_close(linear(lin, x, streamed=True), lin(x), atol=1e-5, rtol=1e-5)
    xg = x.clone().requires_grad_()
    y = linear(lin, xg, streamed=True)
    assert torch.equal(y, torch.nn.functional.linear(xg, lin.weight, lin.bias))
    y.sum().backward()
    assert xg.grad is not None and lin.weight.grad is not None
    with torch.inference_mode():  # an inference tensor (no version counter) is packed once per storage
        inf = torch.nn.Linear(8, 6)
        torch.testing.assert_close(linear(inf, x, streamed=True), inf(x), atol=1e-5, rtol=1e-5)


def test_without_onednn_a_streamed_model_takes_f_linear(monkeypatch):
    import refusion.model.transformer as transformer
    monkeypatch.setattr(transformer, "onednn_packing", lambda: False)
    lin = torch.nn.Linear(8, 6)
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(linear(lin, x, streamed=True), torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert "_onednn_weight" not in lin.__dict__


def test_a_model_larger_than_any_cache_streams_its_weights():
    """Transformer.streamed follows the weights' size (float32 bytes against STREAMED_BYTES)."""
    with torch.device("meta"):
        small = Transformer(ModelConfig(**CFG))
        big = Transformer(ModelConfig(**{**CFG, "vocab_size": 50_000, "hidden_size": 1024, "mask_token_id": 3}))
    assert not small.streamed and not any(b.streamed for b in small.layers)
    assert 4 * sum(p.numel() for p in big.parameters()) > STREAMED_BYTES
    assert big.streamed and all(b.streamed for b in big.layers)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_streamed_model_computes_what_it_did_and_decodes_as_ar(monkeypatch, threads):
    """With every product of a streamed model on oneDNN's packed weights (the layers' and the LM
    head's), logits equal F.linear's within float32 rounding, and greedy speculative decoding is
    still AR's output."""
    n = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _streamed_model_run(monkeypatch)
    finally:
        torch.set_num_threads(n)


def _streamed_model_run(monkeypatch) -> None:
    from refusion.decoding import ARParams, SpeculativeParams, generate_speculative
    from tests.helpers.reference_ar import generate_ar
    import refusion.model.packed as packed

    m = model()
    monkeypatch.setattr(packed, "gemv_one_row", lambda dtype=None: False)  # (every product on the packed weights)
    monkeypatch.setattr(packed, "kernel_rows", lambda dtype=None: range(0))
    calls = []
    real_packed = packed.packed_weight
    monkeypatch.setattr(packed, "packed_weight", lambda lin: calls.append(lin) or real_packed(lin))
    g = torch.Generator().manual_seed(0)
    for T in (1, 2, 4, 5, 7, 16, 17):
        ids = torch.randint(0, 49, (1, T), generator=g)
        m.set_streamed(False)
        want = logits(m, ids.tolist())
        assert not calls
        m.set_streamed(True)
        torch.testing.assert_close(logits(m, ids.tolist()), want, atol=1e-5, rtol=1e-5)
        assert len(calls) == 4 * 2 + 1, T  # 4 products a block, and the LM head
        calls.clear()
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10]]
    ar = generate_ar(m, prompts, ARParams(gen_length=20), eos_ids=[1])
    spec = generate_speculative(m, prompts, SpeculativeParams(gen_length=20, draft_length=6, widths="fixed"),
                                eos_ids=[1])
    assert [r.tokens for r in spec] == [r.tokens for r in ar] and calls
