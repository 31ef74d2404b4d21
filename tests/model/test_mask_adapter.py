"""Mask-only adaptation (model/mask_adapter.py): every non-mask token computes exactly what the base
computes, so greedy `speculative` decoding returns the base model's greedy output; adapters round-trip
through both storage forms; the decoupled variant trains the shared weights exactly as the ARM."""

import json
import random

import pytest
import torch

from refusion.decoding import ARParams
from refusion.decoding.speculative import SpeculativeParams, generate_speculative
from refusion.model.cache import KVCache
from refusion.model.checkpoint import load_model, save_model
from refusion.model.config import ConfigError, ModelConfig
from refusion.model.mask_adapter import (ADAPTER_CONFIG, add_mask_adapter, adapter_parameters, attach_mask_adapter,
                                         save_mask_adapter)
from refusion.model.transformer import Transformer
from refusion.training.trainer import TrainConfig, train
from tests.helpers.reference_ar import generate_ar

MASK = 23
CFG = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
           mask_token_id=MASK, eos_token_id=1)

pytestmark = pytest.mark.usefixtures("one_thread")


def base_model(seed: int = 0) -> Transformer:
    return Transformer(ModelConfig(**CFG)).init_weights(seed=seed, std=0.5).eval()


def adapted(base: Transformer, seed: int = 1) -> Transformer:
    """A copy of base with a mask path whose every weight is random (so it changes the masks a lot)."""
    m = Transformer(ModelConfig(**CFG))
    m.load_state_dict(base.state_dict())
    m.eval()
    add_mask_adapter(m, {"rank": 4})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_parameters(m):
            p.copy_(torch.randn(p.shape, generator=g))
    return m


def feed_with_masks_last(B: int = 3, T: int = 9, masks: tuple[int, ...] = (2, 0, 4)):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, MASK, (B, T), generator=g)
    for b, n in enumerate(masks):
        if n:
            ids[b, T - n:] = MASK
    return ids, torch.arange(T).expand(B, T)


def test_clean_tokens_compute_exactly_what_the_base_computes():
    base = base_model()
    model = adapted(base)
    ids, pos = feed_with_masks_last()
    with torch.no_grad():
        a, b = base(ids, pos), model(ids, pos)
    clean = ids != MASK
    assert torch.equal(a[clean], b[clean])  # bit for bit
    assert (a[~clean] - b[~clean]).abs().max() > 0.1  # and the masks do change
    # on a cache too, and with padding left out (`real`)
    ca, cb = KVCache(2), KVCache(2)
    with torch.no_grad():
        base(ids[:, :4], pos[:, :4], cache=ca), model(ids[:, :4], pos[:, :4], cache=cb)
        real = torch.tensor([4, 5, 6, 9, 10, 12, 13, 14])
        a, b = base(ids[:, 4:], pos[:, 4:], cache=ca, real=real), model(ids[:, 4:], pos[:, 4:], cache=cb, real=real)
    keep = torch.zeros(3 * 5, dtype=torch.bool)
    keep[real - 0] = True
    flat_clean = (ids[:, 4:] != MASK).reshape(-1) & keep
    assert torch.equal(a.reshape(15, -1)[flat_clean], b.reshape(15, -1)[flat_clean])


def test_a_feed_without_masks_runs_no_adapter_product_when_decoding(monkeypatch):
    """A decode step with no mask in it (an AR step, a bare copy) is the base's forward: no adapter
    call on zero rows. With autograd on, the adapters stay in the graph (a trainer's gradients are
    zero for them, not missing)."""
    from refusion.model.mask_adapter import MaskAdapter

    base = base_model()
    model = adapted(base)
    calls = []
    real_add = MaskAdapter.add
    monkeypatch.setattr(MaskAdapter, "add", lambda self, *a: calls.append(1) or real_add(self, *a))
    ids, pos = feed_with_masks_last(masks=(0, 0, 0))
    with torch.inference_mode():
        assert torch.equal(base(ids, pos), model(ids, pos))
    assert calls == []
    with torch.inference_mode():
        model(*feed_with_masks_last())
    assert len(calls) == 4 * 2  # four projections in each of the two blocks
    calls.clear()
    model(ids, pos).sum().backward()
    assert len(calls) == 8
    grads = [p.grad for n, p in adapter_parameters(model) if n != "mask_embedding"]
    assert all(g is not None and not g.any() for g in grads)


def test_a_run_of_masks_a_scattered_set_and_a_trainers_graph_compute_the_same_masks():
    """Decoding takes the adapters' products on views where a row's masks are one run (a slice from
    Transformer.embed), on gathered rows where they are not, and a trainer's graph its own way: the
    masks' logits agree, the clean tokens' are the base's bit for bit in all three."""
    base = base_model()
    model = adapted(base)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, MASK, (1, 9), generator=g)
    run, scattered = ids.clone(), ids.clone()
    run[0, 4:7] = MASK
    scattered[0, [2, 4, 7]] = MASK
    pos = torch.arange(9)[None]
    with torch.no_grad():
        assert isinstance(model.embed(run.view(-1))[1], slice)
        assert torch.equal(model.embed(scattered.view(-1))[1], torch.tensor([2, 4, 7]))
    for feed in (run, scattered):
        with torch.no_grad():
            got, want = model(feed, pos), base(feed, pos)
        trained = model(feed, pos).detach()  # (autograd on: the trainer's path)
        masks = feed == MASK
        clean = masks.cumsum(1) == 0  # (causal: a token after a mask attends to it)
        assert torch.equal(got[clean], want[clean]) and torch.equal(trained[clean], want[clean])
        torch.testing.assert_close(got, trained, rtol=1e-5, atol=1e-4)
        assert (got[masks] - want[masks]).abs().max() > 0.1
    # the products' weights follow an update of the adapter (made again, not kept stale)
    with torch.no_grad():
        before = model(run, pos)
        for n, p in adapter_parameters(model):
            if n.endswith("_B"):
                p.mul_(0.5)
        after = model(run, pos)
    assert not torch.allclose(before[run == MASK], after[run == MASK])
    torch.testing.assert_close(after, model(run, pos).detach(), rtol=1e-5, atol=1e-4)


def test_a_fresh_mask_path_changes_nothing():
    base = base_model()
    m = Transformer(ModelConfig(**CFG))
    m.load_state_dict(base.state_dict())
    m.eval()
    add_mask_adapter(m, {"rank": 4})
    ids, pos = feed_with_masks_last()
    with torch.no_grad():
        assert torch.equal(base(ids, pos), m(ids, pos))


@pytest.mark.parametrize("widths", [dict(), dict(draft_length=4, mask_length=3, widths="fixed"),
                                    dict(fresh_after_miss=False)])
def test_speculative_on_the_adapted_model_is_the_base_models_greedy_output(widths):
    base = base_model(5)
    model = adapted(base, 3)
    rng = random.Random(0)
    prompts = [[rng.randint(2, 22) for _ in range(rng.randint(1, 9))] for _ in range(6)]
    # the base's own greedy decoding: every token, the first included, from the causal path
    want = [r.tokens for r in generate_ar(base, prompts, ARParams(gen_length=24, first_from_mask=False), eos_ids=[1])]
    assert model.config.causal_first_token and not base.config.causal_first_token
    # a committed <|mask|> would take the mask path (the one case the guarantee excludes): this base emits none
    assert all(MASK not in t for t in want)
    got = generate_speculative(model, prompts, SpeculativeParams(gen_length=24, **widths), eos_ids=[1])
    assert [r.tokens for r in got] == want
    # not vacuous: the adapted masks were fed beside the clean tokens (and change logits: test above),
    # more than AR's prompts and one token per forward
    assert sum(r.tokens_fed for r in got) > sum(map(len, prompts)) + sum(r.forwards for r in got)


def test_a_mask_adapted_model_drafts_afresh_after_a_miss_by_default():
    """fresh_after_miss unset: on for a model with a mask adapter, off for one without; set, as set."""
    from refusion.decoding.speculative import SpeculativeBatch

    base = base_model(5)
    for model, default in ((adapted(base, 3), True), (base, False)):
        batch = SpeculativeBatch(model, eos_ids=[1])
        for value, want in ((None, default), (True, True), (False, False)):
            batch.add([2, 3], SpeculativeParams(gen_length=4, fresh_after_miss=value))
            assert batch.pending[-1].fresh_after_miss is want


def test_adapter_round_trips_alone_and_inside_a_model_directory(tmp_path):
    base = base_model()
    model = adapted(base)
    ids, pos = feed_with_masks_last()
    with torch.no_grad():
        want = model(ids, pos)
    save_model(base, tmp_path / "base")
    save_mask_adapter(model, tmp_path / "adapter", base=str(tmp_path / "base"))
    assert json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["rank"] == 4
    again = attach_mask_adapter(load_model(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(again(ids, pos), want)
    save_model(model, tmp_path / "whole")
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["mask_adapter"] == {"rank": 4, "alpha": 8.0}
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "whole")(ids, pos), want)


def test_adapter_refuses_a_base_it_was_not_made_for(tmp_path):
    model = adapted(base_model())
    save_mask_adapter(model, tmp_path / "adapter", base="somewhere")
    other = Transformer(ModelConfig(**{**CFG, "vocab_size": 30})).eval()
    with pytest.raises(ConfigError, match="vocab_size 24"):
        attach_mask_adapter(other, tmp_path / "adapter")
    no_mask = Transformer(ModelConfig(**{**CFG, "mask_token_id": None})).eval()
    with pytest.raises(ConfigError, match="needs a mask token"):
        add_mask_adapter(no_mask, {"rank": 2})
    with pytest.raises(ConfigError, match="already has a mask adapter"):
        add_mask_adapter(model, {"rank": 2})


# ---- the decoupled variant -------------------------------------------------------------------------


def test_decoupled_training_leaves_the_shared_weights_exactly_the_arms(tmp_path):
    rng = random.Random(0)
    recs = [{"query": f"What is {a} plus {b}?", "response": f"{a} + {b} = {a + b}."}
            for a, b in ((rng.randint(1, 30), rng.randint(1, 30)) for _ in range(200))]
    data = tmp_path / "add.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in recs))
    common = dict(data=str(data), vocab_size=300, batch_size=8, micro_batch_size=4, max_steps=10, warmup_steps=2,
                  lr=3e-3, save_every=1000, model=dict(hidden_size=32, intermediate_size=64, num_layers=2,
                                                       num_heads=4, num_kv_heads=2))
    train(TrainConfig(objective="ar", mask_token=True, out_dir=str(tmp_path / "arm"), **common))
    common["tokenizer"] = str(tmp_path / "arm" / "tokenizer")
    train(TrainConfig(objective="refusion", variant="decoupled", mask_adapter={"rank": 4},
                      out_dir=str(tmp_path / "dec"), **common))
    arm, dec = load_model(tmp_path / "arm" / "model"), load_model(tmp_path / "dec" / "model")
    sa, sd = arm.state_dict(), dec.state_dict()
    assert all(torch.equal(sa[k], sd[k]) for k in sa)
    assert set(sd) - set(sa) == {n for n, _ in adapter_parameters(dec)}
    # the mask path did learn: its B matrices left zero
    assert all(block.mask_adapter.qkv_proj_B.abs().sum() > 0 for block in dec.layers)
    arm_log = [json.loads(x) for x in (tmp_path / "arm" / "metrics.jsonl").read_text().splitlines()]
    dec_log = [json.loads(x) for x in (tmp_path / "dec" / "metrics.jsonl").read_text().splitlines()]
    assert [r["ar_loss"] for r in arm_log] == [r["ar_loss"] for r in dec_log]
    assert [r["grad_norm"] for r in arm_log] == [r["grad_norm"] for r in dec_log]
    assert dec_log[-1]["mdm_loss"] < dec_log[0]["mdm_loss"]


def test_masks_on_the_clean_cache_equal_the_packed_draft_layout():
    """The decoupled pass (clean tokens once into a cache, no graph; masks on top) gives the packed
    draft layout's mask logits and the same gradients of the mask path."""
    from refusion.training.joint_layouts import draft_inputs, draft_masks
    from refusion.training.objectives import ar_inputs, make_batch

    model = adapted(base_model(), 4)
    model.train()
    rng = random.Random(1)
    prompts = [[rng.randint(2, 22) for _ in range(rng.randint(1, 6))] for _ in range(5)]
    responses = [[rng.randint(2, 22) for _ in range(rng.randint(0, 12))] + [1] for _ in range(5)]
    batch = make_batch(prompts, responses, 0)
    packed = draft_inputs(batch, MASK, torch.Generator().manual_seed(3), slot_sizes=(2, 3, 5))
    masks = draft_masks(batch, MASK, torch.Generator().manual_seed(3), slot_sizes=(2, 3, 5))
    own = [p for _, p in adapter_parameters(model)]

    logits = model(packed.input_ids, packed.position_ids, packed.attn_mask)
    want = torch.stack([logits[b][packed.is_masked[b]].sum(0) for b in range(5)])  # per example, summed
    grads_want = torch.autograd.grad(want.sum(), own)

    clean = ar_inputs(batch)
    cache = KVCache(2)
    with torch.no_grad():
        model(clean.input_ids, clean.position_ids, None, cache=cache)
    out = model(masks.input_ids, masks.position_ids, masks.attn_mask(len(cache)), cache=cache)
    got = torch.stack([out[b][masks.valid[b]].sum(0) for b in range(5)])
    grads_got = torch.autograd.grad(got.sum(), own)
    assert torch.allclose(got, want, atol=1e-4)
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(grads_got, grads_want, strict=True))
    assert torch.equal(masks.labels[masks.valid], packed.labels[packed.is_masked])
