"""The mask-only variant on cached features (training/mask_features.py, `feature_cache`): the adapted
blocks fed the stored features compute the same loss and gradients as the full mask-only pass over
the same blocks of masks; a run trains only the top blocks' adapters, keeps the mask embedding and
the base as they were, and resumes exactly."""

import dataclasses
import json
import shutil

import pytest
import torch

from refusion.model.checkpoint import add_mask_token, load_model
from refusion.model.config import ConfigError
from refusion.model.mask_adapter import ADAPTER_WEIGHTS, adapter_parameters, add_mask_adapter, attach_mask_adapter
from refusion.model.tokenizer import Tokenizer
from refusion.model.transformer import Transformer
from refusion.training.data import Example
from refusion.training.joint_layouts import DraftMasks
from refusion.training.mask_features import (PrefixCache, block_starts, example_features, feature_batch,
                                             feature_loss, feature_phases, prepare_features)
from refusion.training.objectives import token_ce
from refusion.training.setup import setup
from refusion.training.trainer import TrainConfig, fit
from tests.helpers.tiny_causal_lm import addition_records, assert_clean_logits_are_the_bases, base_dir, data_file  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def adapted_model(base_dir, layers: int, seed: int = 3):
    """The base with a mask token and adapters on its top `layers` blocks, their B drawn (not zero), so
    the adapters change the masks' outputs."""
    model, tok = load_model(base_dir), Tokenizer.from_dir(base_dir)
    add_mask_token(model, tok)
    add_mask_adapter(model, {"rank": 4, "layers": layers})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter_parameters(model):
            if name.endswith("_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, tok


def examples(tok, n: int = 3) -> list[Example]:
    recs = addition_records()[:n]
    return [Example(tok.chat_prompt_ids(r["query"]), tok.encode(r["response"]) + [tok.eos_id]) for r in recs]


def full_pass_loss(model, exs: list[Example], phases: list[int], S: int) -> torch.Tensor:
    """The mask-only variant's own pass (step._mask_only_backward): each example's clean tokens into a
    cache, then its masks in blocks of S at `phase` over every block of the model; mean mask CE per
    example, summed, over len(exs)."""
    total = 0
    for ex, phase in zip(exs, phases, strict=True):
        pl, R = len(ex.prompt), len(ex.response)
        ids = torch.tensor([list(ex.prompt) + list(ex.response)])
        cache = model.new_cache()
        with torch.no_grad():
            model(ids, torch.arange(ids.shape[1])[None], cache=cache)
        block = block_starts(R, torch.tensor([phase]), S)
        i = torch.arange(R)[None]
        resp = torch.tensor([list(ex.response)])
        masks = DraftMasks(torch.full((1, R), model.config.mask_token_id), pl + i, resp, torch.ones(1, R, dtype=torch.bool),
                           pl + block, block)
        logits = model(masks.input_ids, masks.position_ids, masks.attn_mask(len(cache)), cache=cache)
        total = total + token_ce(logits, masks.labels).sum() / R
    return total / len(exs)


@pytest.mark.parametrize("layers", [2, 1])
def test_the_adapted_blocks_on_features_compute_the_full_passs_loss_and_gradients(base_dir, layers):
    model, tok = adapted_model(base_dir, layers)
    assert [b.__dict__["_modules"].get("mask_adapter") is not None for b in model.layers] == \
        [i >= model.config.num_layers - layers for i in range(model.config.num_layers)]
    exs, S = examples(tok), 4
    phases = [torch.tensor([0, 2]), torch.tensor([1, 3]), torch.tensor([3, 0])]
    feats = [example_features(model, ex, p, S, dtype=torch.float32) for ex, p in zip(exs, phases, strict=True)]
    draws = [(0, 1), (1, 0), (2, 0)]  # (example, phase row): phases 2, 1, 3
    first = model.config.num_layers - layers
    loss, stats = feature_loss(model, feature_batch(feats, draws, S, first, torch.float32), len(draws))
    params = [p for _, p in adapter_parameters(model) if p.ndim == 2]
    got = torch.autograd.grad(loss, params)
    want_loss = full_pass_loss(model, exs, [2, 1, 3], S)
    want = torch.autograd.grad(want_loss, params, allow_unused=True)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w if w is not None else torch.zeros_like(g), rtol=1e-4, atol=1e-6)
    assert sum(int(stats[f"masks_{o}"]) for o in range(5)) == int(stats["n_masked_tokens"]) == \
        sum(len(exs[e].response) for e, _ in draws)


def test_block_starts_and_phases():
    # phase 0: blocks of 4 from 0; phase 1: the first block holds 3 masks, then 3, 7
    assert block_starts(9, torch.tensor([0, 1]), 4).tolist() == [[0, 0, 0, 0, 4, 4, 4, 4, 8], [0, 0, 0, 3, 3, 3, 3, 7, 7]]
    ph = feature_phases(50, 4, 16, seed=0)
    assert ph.shape == (50, 4) and ((ph[:, 1:] - ph[:, :1]) % 16 == torch.tensor([4, 8, 12])).all()
    assert set(ph[:, 0].tolist()) == {0, 1, 2, 3}  # the offsets vary over examples
    with pytest.raises(ValueError, match="needs its attention mask"):
        PrefixCache({}, {}).default_mask(3, torch.device("cpu"))


def config(base_dir, data_file, out, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(objective="refusion", variant="mask-only", init=str(base_dir), data=str(data_file),
                                 out_dir=str(out), mask_adapter={"rank": 4, "layers": 1}, feature_cache=True,
                                 feature_phases=2, slot_sizes=[2, 4], batch_size=8, micro_batch_size=4, max_steps=6,
                                 warmup_steps=1, lr=1e-2, save_every=3), **kw})


def metrics(out) -> list[dict]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("seconds", "tokens_per_s", "layout_s")} for r in recs]


def test_a_feature_run_trains_the_top_adapters_alone_and_resumes_exactly(base_dir, data_file, tmp_path):
    out = tmp_path / "run"
    run = setup(config(base_dir, data_file, out))
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in adapter_parameters(run.model)} - {"mask_embedding"}
    assert all(n.startswith(f"layers.{run.model.config.num_layers - 1}.") for n in trainable)
    final = fit(run, progress=False)
    assert {p.name for p in (out / "features").iterdir()} >= {"features.json", "000000.safetensors"}
    log = metrics(out)
    assert [r["step"] for r in log] == list(range(1, 7))
    assert log[-1]["loss"] < log[0]["loss"] and all(0 <= r["mask_acc_0"] <= 1 for r in log)
    # the base, the mask embedding included, did not move; the top block's adapter did
    model, tok = load_model(base_dir), Tokenizer.from_dir(base_dir)
    add_mask_token(model, tok)
    start = model.embed_tokens.weight[model.config.mask_token_id]
    assert torch.equal(run.model.mask_embedding.detach(), start)
    base = model.state_dict()
    assert all(torch.equal(v, run.model.state_dict()[k]) for k, v in base.items())
    assert run.model.layers[-1].mask_adapter.qkv_proj_B.abs().sum() > 0
    # the result loads on its base: clean logits are the base's, bit for bit
    model2 = load_model(base_dir)
    add_mask_token(model2, tok)
    assert_clean_logits_are_the_bases(model, attach_mask_adapter(model2, final), tok)
    # resumed from checkpoint-3 (the features reused, not rewritten), the run ends exactly as the uninterrupted one
    want = (final / ADAPTER_WEIGHTS).read_bytes()
    shard = out / "features" / "000000.safetensors"
    written = shard.stat().st_mtime_ns
    shutil.rmtree(out / "checkpoint-6")
    shutil.rmtree(final)
    fit(setup(config(base_dir, data_file, out)), progress=False)
    assert shard.stat().st_mtime_ns == written
    assert metrics(out) == log
    assert (final / ADAPTER_WEIGHTS).read_bytes() == want


def test_feature_cache_is_refused_where_it_cannot_apply(base_dir, data_file, tmp_path):
    with pytest.raises(ConfigError, match="feature_cache trains a mask-only adapter"):
        config(base_dir, data_file, tmp_path / "x", variant="hybrid", mask_adapter=None).validate()
    with pytest.raises(ConfigError, match="feature_phases 8 is more than"):
        config(base_dir, data_file, tmp_path / "x", feature_phases=8).validate()
    with pytest.raises(ConfigError, match="mask_adapter.layers"):
        config(base_dir, data_file, tmp_path / "x", mask_adapter={"layers": 0}).validate()
    model, tok = adapted_model(base_dir, 1)
    with pytest.raises(ConfigError, match="mask_adapter.layers is 9 but the model has 2 blocks"):
        Transformer(dataclasses.replace(model.config, mask_adapter={"rank": 2, "layers": 9}))
    out = tmp_path / "feats"
    prepare_features(model, examples(tok, 2), out, 2, 4, seed=0, progress=False, log=lambda m: None)
    with pytest.raises(ValueError, match="holds features of another run"):
        prepare_features(model, examples(tok, 3), out, 2, 4, seed=0, progress=False, log=lambda m: None)
