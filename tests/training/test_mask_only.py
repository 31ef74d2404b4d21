"""The mask-only variant (training/variants.py): a pretrained causal LM, frozen, gains a mask path; its
weights and every clean token's logits stay the base's to the bit, checkpoints hold the adapters
alone, and a run resumes exactly."""

import json
import shutil

import pytest
import torch

from refusion.model.checkpoint import add_mask_token, load_model
from refusion.model.config import ConfigError
from refusion.model.mask_adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_parameters, attach_mask_adapter
from refusion.model.tokenizer import Tokenizer
from refusion.training.joint_layouts import base_distribution, draft_masks
from refusion.training.mask_features import offset_accuracy, offset_hits
from refusion.training.objectives import ar_inputs, soft_ce, token_ce
from refusion.training.setup import setup
from refusion.training.step import _global_batch, train_step
from refusion.training.trainer import TrainConfig, fit
from tests.helpers.tiny_causal_lm import assert_clean_logits_are_the_bases, base_dir, data_file  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_thread")


def config(base_dir, data_file, out, **kw) -> TrainConfig:
    return TrainConfig(**{**dict(objective="refusion", variant="mask-only", init=str(base_dir), data=str(data_file),
                                 out_dir=str(out), mask_adapter={"rank": 4}, batch_size=8, micro_batch_size=4,
                                 max_steps=6, warmup_steps=1, lr=1e-2, save_every=3), **kw})


def base_with_mask(base_dir):
    model, tok = load_model(base_dir), Tokenizer.from_dir(base_dir)
    add_mask_token(model, tok)
    return model, tok


def metrics(out) -> list[dict]:
    """metrics.jsonl without the timings"""
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("seconds", "tokens_per_s", "layout_s")} for r in recs]


@pytest.mark.parametrize("target", ["token", "distribution"])
def test_mask_only_trains_the_mask_path_alone_and_resumes_exactly(base_dir, data_file, tmp_path, target):
    out = tmp_path / "run"
    run = setup(config(base_dir, data_file, out, mask_target=target))
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in adapter_parameters(run.model)}
    held = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    assert held == {id(p) for _, p in adapter_parameters(run.model)}
    final = fit(run, progress=False)
    assert final == out / "adapter"
    # the base's weights did not move by a bit (the mask row of the table included)
    base, tok = base_with_mask(base_dir)
    trained = run.model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in base.state_dict().items())
    # the mask path learned
    assert run.model.layers[0].mask_adapter.qkv_proj_B.abs().sum() > 0
    log = metrics(out)
    assert [r["step"] for r in log] == list(range(1, 7))
    # the base's own loss is logged where its logits are computed anyway (the distribution targets)
    assert all(r["ar_loss"] > 0 if target == "distribution" else "ar_loss" not in r for r in log)
    assert all(r["loss"] == r["mdm_loss"] for r in log)
    assert all(0 <= r[f"mask_acc_{o}"] <= 1 for r in log for o in range(5))
    # checkpoints and the result hold the mask path (and the training state), never the base
    for d in (out / "checkpoint-3", out / "checkpoint-6"):
        assert {p.name for p in d.iterdir()} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "training_state.pt"}
    assert {p.name for p in final.iterdir()} == {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    assert json.loads((final / ADAPTER_CONFIG).read_text())["base"] == str(base_dir.resolve())
    # the adapter on its base: clean tokens' logits are the base's, bit for bit; masks' are not
    assert_clean_logits_are_the_bases(base, attach_mask_adapter(base_with_mask(base_dir)[0], final), tok)
    # resumed from checkpoint-3, the run logs and ends exactly as the uninterrupted one
    want = (final / ADAPTER_WEIGHTS).read_bytes()
    shutil.rmtree(out / "checkpoint-6")
    shutil.rmtree(final)
    fit(setup(config(base_dir, data_file, out, mask_target=target)), progress=False)
    assert metrics(out) == log
    assert (final / ADAPTER_WEIGHTS).read_bytes() == want


def test_mask_only_needs_a_pretrained_model_and_trains_alone(base_dir, data_file, tmp_path):
    with pytest.raises(ConfigError, match="set init"):
        config(base_dir, data_file, tmp_path / "x", init=None).validate()
    with pytest.raises(ConfigError, match="does not combine with lora"):
        config(base_dir, data_file, tmp_path / "x", lora={"r": 2}).validate()
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        config(base_dir, data_file, tmp_path / "x", gradient_checkpointing=True).validate()
    with pytest.raises(ConfigError, match="mask_adapter sizes the decoupled and mask-only"):
        config(base_dir, data_file, tmp_path / "x", variant="joint").validate()


def test_distribution_targets_are_the_bases_next_token_distributions_at_the_masks(base_dir, data_file, tmp_path):
    """mask_target "distribution": mask i of a row learns the in-order pass's distribution from the column
    whose label is that mask's token (prompt_len + i - 1), and the soft cross-entropy against a one-hot
    target is the token's cross-entropy."""
    run = setup(config(base_dir, data_file, tmp_path / "run", mask_target="distribution"))
    batch = _global_batch(run, run.order(0))
    clean = ar_inputs(batch)
    masks = draft_masks(batch, run.model.config.mask_token_id, torch.Generator().manual_seed(0), (4, 8))
    with torch.no_grad():
        logits = run.model(clean.input_ids, clean.position_ids, None)
    base = base_distribution(logits, batch.prompt_len, masks.valid)
    for b in range(len(batch.prompt_len)):
        pl = int(batch.prompt_len[b])
        for i in range(masks.valid.shape[1]):
            if masks.valid[b, i]:
                assert clean.labels[b, pl + i - 1] == masks.labels[b, i]
                assert torch.allclose(base[b, i], logits[b, pl + i - 1].float().softmax(-1), atol=1e-7)
            else:
                assert not base[b, i].any()
    mask_logits = torch.randn(*masks.valid.shape, logits.shape[-1], generator=torch.Generator().manual_seed(1))
    one_hot = torch.nn.functional.one_hot(masks.labels.clamp(min=0), logits.shape[-1]).float()
    want = token_ce(mask_logits, masks.labels)
    assert torch.allclose(soft_ce(mask_logits, one_hot, masks.valid), want, atol=1e-5)
    assert not soft_ce(mask_logits, one_hot, masks.valid)[~masks.valid].any()
    # the option reaches the training loss: at step 1 (adapters at zero effect) both runs' masks predict
    # the same tokens, and their losses differ (the base's distribution against its argmax token)
    first = {t: train_step(setup(config(base_dir, data_file, tmp_path / t, mask_target=t))) for t in
             ("token", "distribution")}
    assert all(first["token"][f"mask_acc_{o}"] == first["distribution"][f"mask_acc_{o}"] for o in range(5))
    assert first["token"]["mdm_loss"] != first["distribution"]["mdm_loss"]


def test_mask_accuracy_is_counted_per_block_offset():
    # predictions 0, 1, 2, 3, 4, 5 against targets 0, 1, 9, 3, 4, 9 at offsets 0, 1, 1, 2, 4, 7
    stats = offset_hits(torch.arange(6), torch.tensor([0, 1, 9, 3, 4, 9]), torch.tensor([0, 1, 1, 2, 4, 7]))
    assert offset_accuracy(stats) == {"mask_acc_0": 1.0, "mask_acc_1": 0.5, "mask_acc_2": 1.0, "mask_acc_3": 0.0,
                                      "mask_acc_4": 0.5}
    assert stats == {}  # the counts were taken out


def test_mask_target_is_for_the_mask_only_variant(base_dir, data_file, tmp_path):
    with pytest.raises(ConfigError, match="mask_target must be"):
        config(base_dir, data_file, tmp_path / "x", mask_target="logits").validate()
    with pytest.raises(ConfigError, match="needs variant = \"mask-only\" without feature_cache"):
        config(base_dir, data_file, tmp_path / "x", mask_target="distribution", feature_cache=True,
               mask_adapter={"rank": 4, "layers": 1}).validate()
    with pytest.raises(ConfigError, match="needs variant"):
        TrainConfig(objective="refusion", variant="joint", mask_target="distribution").validate()
