"""Packed rows (training/packing.py, TrainConfig.pack): the packed mask by hand, first-fit decreasing,
every packable layout's loss and gradients against the same examples unpacked, the trainer with and
without packing, an exact resume, and the variants that refuse to pack."""

import json
import random
from pathlib import Path

import pytest
import torch

from refusion.model.config import ConfigError, ModelConfig
from refusion.model.transformer import Transformer
from refusion.training.config import TrainConfig
from refusion.training.data import BatchOrder
from refusion.training.joint_layouts import draft_inputs, hybrid_inputs, joint_hybrid_inputs
from refusion.training.objectives import (IGNORE, ar_inputs, ar_token_count, compute_loss, loss_from_ce, make_batch,
                                         mdm_inputs, refusion_inputs, token_ce)
from refusion.training.packing import first_fit_decreasing, pack
from refusion.training.trainer import train
from tests.helpers.train_helpers import write_jsonl

MASK, PAD, EOS = 99, 0, 2
X = IGNORE
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------------
# the packing itself


def test_first_fit_decreasing_longest_first_into_the_first_row_with_room():
    assert first_fit_decreasing([3, 4, 1], 4) == [[1], [0, 2]]
    assert first_fit_decreasing([2, 5, 3, 2, 1, 4], 5) == [[1], [5, 4], [2, 0], [3]]
    assert first_fit_decreasing([2, 2, 2], 2) == [[0], [1], [2]]  # ties keep their order
    assert first_fit_decreasing([0, 0], 0) == [[0, 1]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_decreasing([3], 2)


def test_packed_ar_rows_by_hand():
    # lengths 3, 4, 1: example 1 fills a row of 4; examples 0 and 2 share the other
    batch = make_batch([[10], [11, 12], [13]], [[20, EOS], [21, EOS], []], PAD)
    x = ar_inputs(batch)
    p = pack(x, PAD)
    assert p.inputs.input_ids.tolist() == [[11, 12, 21, EOS], [10, 20, EOS, 13]]
    assert p.inputs.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0]]  # positions restart per example
    assert p.inputs.labels.tolist() == [[X, 21, EOS, X], [20, EOS, X, X]]
    assert not p.inputs.pad.any()
    # causal inside each example, nothing across examples
    assert p.inputs.attn_mask[1, 0].int().tolist() == [[1, 0, 0, 0],
                                                       [1, 1, 0, 0],
                                                       [1, 1, 1, 0],
                                                       [0, 0, 0, 1]]
    assert p.inputs.attn_mask[0, 0].int().tolist() == torch.ones(4, 4).tril().int().tolist()
    # the unpacked column (b, c) sits at flat index index[b, c] of the packed rows
    assert p.index[p.real].tolist() == [4, 5, 6, 0, 1, 2, 3, 7]
    assert torch.equal(p.unpack(p.inputs.input_ids.float()), torch.where(~x.pad, x.input_ids, 0).float())


def test_packed_mdm_rows_by_hand_bidirectional_blocks_and_a_padding_column():
    # lengths 4, 2, 1: rows [0] and [1, 2], the second with one padding column
    batch = make_batch([[10, 11], [12], [13]], [[20, EOS], [EOS], []], PAD)
    x = mdm_inputs(batch, MASK, gen(0))
    p = pack(x, PAD)
    assert p.inputs.pad.tolist() == [[False] * 4, [False, False, False, True]]
    assert p.inputs.input_ids[1].tolist() == [12, int(x.input_ids[1, 1]), 13, PAD]
    assert p.inputs.position_ids[1].tolist() == [0, 1, 0, 0]
    assert p.inputs.attn_mask[1, 0].int().tolist() == [[1, 1, 0, 0],
                                                       [1, 1, 0, 0],
                                                       [0, 0, 1, 0],
                                                       [0, 0, 0, 1]]  # padding sees only itself
    assert p.inputs.attn_mask[0, 0].all()
    assert torch.equal(p.inputs.is_masked[1], torch.tensor([False, bool(x.is_masked[1, 1]), False, False]))
    assert torch.equal(p.inputs.mask_rate, x.mask_rate)  # per example, not per row


def test_packed_refusion_row_keeps_the_permuted_layout_and_its_causal_mask():
    rng = random.Random(3)
    batch = make_batch([[rng.randint(3, 90) for _ in range(3)] for _ in range(4)],
                       [[rng.randint(3, 90) for _ in range(n)] + [EOS] for n in (11, 2, 5, 1)], PAD)
    x = refusion_inputs(batch, MASK, gen(4), slot_sizes=(2, 4))
    p = pack(x, PAD)
    lengths = (~x.pad).sum(1).tolist()
    assert lengths == [15, 6, 9, 5]
    assert [int(r) for r in (~p.inputs.pad).sum(1)] == [15, 15, 5]  # rows [0], [2, 1], [3]
    for b, n in enumerate(lengths):  # every example's columns, whole and in feed order, somewhere in a row
        flat = p.index[b, :n]
        r, at = divmod(int(flat[0]), p.inputs.input_ids.shape[1])
        assert flat.tolist() == list(range(int(flat[0]), int(flat[0]) + n))
        for name in ("input_ids", "position_ids", "labels", "is_masked"):
            assert torch.equal(getattr(p.inputs, name)[r, at:at + n], getattr(x, name)[b, :n]), name
        assert torch.equal(p.inputs.attn_mask[r, 0, at:at + n, at:at + n], x.attn_mask[b, 0, :n, :n])
        # and nothing of another example in its rows or columns
        others = torch.ones(p.inputs.input_ids.shape[1], dtype=torch.bool)
        others[at:at + n] = False
        assert not p.inputs.attn_mask[r, 0, at:at + n][:, others].any()
        assert not p.inputs.attn_mask[r, 0, others][:, at:at + n].any()


# ------------------------------------------------------------------------------------------------
# packed loss and gradients == unpacked, every layout that packs


def random_batch(seed: int, B: int = 7, max_p: int = 6, max_r: int = 19):
    rng = random.Random(seed)
    prompts, responses = [], []
    for b in range(B):
        lp = 0 if b == 1 else rng.randint(1, max_p)
        lr = 0 if b == 4 else rng.randint(1, max_r)
        prompts.append([rng.randint(3, 90) for _ in range(lp)])
        responses.append([rng.randint(3, 90) for _ in range(lr - 1)] + [EOS] if lr else [])
    return make_batch(prompts, responses, PAD)


LAYOUTS = {
    "ar": ("ar", lambda b, g: ar_inputs(b)),
    "mdm": ("mdm", lambda b, g: mdm_inputs(b, MASK, g)),
    "paper": ("refusion", lambda b, g: refusion_inputs(b, MASK, g, (2, 4, 8))),
    "boundary": ("refusion", lambda b, g: refusion_inputs(b, MASK, g, (2, 4, 8), boundary=True)),
    "ar-share": ("refusion", lambda b, g: refusion_inputs(b, MASK, g, (2, 4, 8), boundary=True, ar_share=0.5)),
    "hybrid": ("refusion", lambda b, g: hybrid_inputs(b, MASK, g, (2, 4, 8))),
    "joint": ("refusion", lambda b, g: draft_inputs(b, MASK, g, (2, 4, 8))),
    "joint-hybrid": ("refusion", lambda b, g: joint_hybrid_inputs(b, MASK, g, (2, 4, 8))),  # a p per column
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=100, mask_token_id=MASK, **TINY)
    return Transformer(cfg).init_weights(seed=0)


def loss_and_grads(model, objective, x, batch, packed=None):
    model.zero_grad(set_to_none=True)
    n_ar = ar_token_count(x)
    if packed is None:  # as the trainer feeds an unpacked batch
        logits = model(x.input_ids, x.position_ids, None if x.attention is None else x.attn_mask)
        loss, stats = compute_loss(objective, logits, x, batch, n_ar, len(batch.response_len))
    else:
        p = packed.inputs
        ce = packed.unpack(token_ce(model(p.input_ids, p.position_ids, p.attn_mask), p.labels))
        loss, stats = loss_from_ce(objective, ce, x, batch.response_len, n_ar, len(batch.response_len))
    loss.backward()
    return loss.detach(), stats, {n: q.grad.clone() for n, q in model.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_loss_and_gradients_equal_unpacked(layout, seed, model):
    objective, build = LAYOUTS[layout]
    batch = random_batch(seed)
    x = build(batch, gen(seed))
    packed = pack(x, PAD)
    assert packed.inputs.input_ids.shape[0] < x.input_ids.shape[0]  # something was packed
    assert torch.equal(build(batch, gen(seed)).input_ids, x.input_ids)  # the same draws either way
    loss, stats, grads = loss_and_grads(model, objective, x, batch)
    loss_p, stats_p, grads_p = loss_and_grads(model, objective, x, batch, packed)
    assert abs(loss_p.item() - loss.item()) <= 1e-6 * max(1.0, abs(loss.item())), (loss_p.item(), loss.item())
    for k in stats:
        if k.startswith("n_"):
            assert stats_p[k] == stats[k], k
    for name, g in grads.items():
        torch.testing.assert_close(grads_p[name], g, rtol=1e-5, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------------
# in the trainer


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """Addition problems with answers of several lengths, so batches have something to pack."""
    rng = random.Random(0)
    recs = []
    for _ in range(200):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        words = " ".join(["and so"] * rng.randint(0, 12))
        recs.append({"query": f"What is {a} plus {b}?", "response": f"{a} + {b} {words} = {a + b}."})
    return write_jsonl(tmp_path_factory, recs)


def run_losses(data_file: Path, out: Path, **kw) -> list[dict]:
    """A short run's metrics; batches of random examples (length-grouped ones leave little to pack)."""
    cfg = dict(data=str(data_file), out_dir=str(out), vocab_size=300, model=dict(TINY), batch_size=8, max_steps=6,
               warmup_steps=2, lr=3e-3, save_every=3, length_grouping=False)
    cfg.update(kw)
    train(TrainConfig(**cfg), progress=False)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("objective, variant", [("refusion", None), ("refusion", "paper"), ("mdm", None)])
def test_training_packed_gives_the_unpacked_losses(objective, variant, data_file, tmp_path):
    a = run_losses(data_file, tmp_path / "a", objective=objective, variant=variant)
    b = run_losses(data_file, tmp_path / "b", objective=objective, variant=variant, pack=True, micro_batch_size=4)
    assert len(a) == len(b) == 6
    for ra, rb in zip(a, b, strict=True):
        assert ra["tokens"] == rb["tokens"] and ra["lr"] == rb["lr"]
        for k in ("loss", "ar_loss", "mdm_loss", "grad_norm"):
            if k in ra:
                assert rb[k] == pytest.approx(ra[k], rel=1e-5, abs=1e-6), k


def test_packed_run_resumes_exactly(data_file, tmp_path):
    ref = run_losses(data_file, tmp_path / "ref", objective="ar", pack=True)
    run_losses(data_file, tmp_path / "run", objective="ar", pack=True, stop_after=3)
    resumed = run_losses(data_file, tmp_path / "run", objective="ar", pack=True)
    keep = ("step", "loss", "grad_norm", "lr", "tokens")
    assert [{k: r[k] for k in keep} for r in resumed] == [{k: r[k] for k in keep} for r in ref]


def test_batches_without_length_grouping_are_random_and_deterministic():
    lengths = list(range(400))  # every length once: a batch's spread tells grouped from random
    grouped, mixed = BatchOrder(lengths, 8, seed=1), BatchOrder(lengths, 8, seed=1, grouped=False)
    for order in (grouped, mixed):
        epoch = [order(s) for s in range(order.per_epoch)]
        assert sorted(i for b in epoch for i in b) == lengths  # each example once per epoch
        assert epoch == [BatchOrder(lengths, 8, 1, order.pool == 50)(s) for s in range(order.per_epoch)]

    def spread(order):
        return sum(max(order(s)) - min(order(s)) for s in range(order.per_epoch)) / order.per_epoch

    assert spread(grouped) < 20 < 200 < spread(mixed)  # random batches of 8 from 400 spread ~311


@pytest.mark.parametrize("variant", ["decoupled", "mask-only"])
def test_variants_with_a_cache_pass_refuse_to_pack(variant):
    with pytest.raises(ConfigError, match=f"pack: the {variant} variant"):
        TrainConfig(variant=variant, init="smollm2", pack=True).validate(check_files=False)


def test_mask_loss_weight_reaches_the_trainer(data_file, tmp_path):
    """joint-hybrid (a mask rate per column) trains packed as unpacked; the logged loss is AR plus
    mask_loss_weight times the (unweighted) logged mask term, and the first step's terms are the
    unweighted run's (the same draws, the same weights)."""
    plain = run_losses(data_file, tmp_path / "plain", variant="joint-hybrid")
    heavy = run_losses(data_file, tmp_path / "heavy", variant="joint-hybrid", mask_loss_weight=2.5)
    packed = run_losses(data_file, tmp_path / "packed", variant="joint-hybrid", mask_loss_weight=2.5, pack=True,
                        micro_batch_size=4)
    assert heavy[0]["ar_loss"] == pytest.approx(plain[0]["ar_loss"], rel=1e-6)
    assert heavy[0]["mdm_loss"] == pytest.approx(plain[0]["mdm_loss"], rel=1e-6)
    for r in heavy:
        assert r["loss"] == pytest.approx(r["ar_loss"] + 2.5 * r["mdm_loss"], rel=1e-5)
    assert heavy[-1]["ar_loss"] != pytest.approx(plain[-1]["ar_loss"], rel=1e-4)  # the weight changed the steps
    for rh, rp in zip(heavy, packed, strict=True):
        for k in ("loss", "ar_loss", "mdm_loss", "grad_norm"):
            assert rp[k] == pytest.approx(rh[k], rel=1e-5, abs=1e-6), k
