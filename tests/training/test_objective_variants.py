"""The refusion objective's variants (spec section 8; training/variants.py, training/joint_layouts.py):
hand-built layouts, the rule every layout must keep checked by reachability on random layouts,
ar-share:1 as exactly next-token training, losses against hand sums, and config errors."""

import random

import pytest
import torch
import torch.nn.functional as F

from refusion.model.config import ConfigError
from refusion.training.config import TrainConfig
from refusion.training.joint_layouts import draft_inputs, hybrid_inputs, joint_hybrid_inputs
from refusion.training.objectives import (IGNORE, ar_inputs, loss_from_ce, make_batch, refusion_inputs,
                                         refusion_loss)
from refusion.training.variants import Variant, parse_variant

MASK, PAD, EOS = 99, 0, 2
X = IGNORE


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_examples(rng: random.Random, B: int, max_p: int, max_r: int):
    prompts, responses = [], []
    for b in range(B):
        lp = 0 if b == 1 else rng.randint(1, max_p)
        lr = 0 if b % 5 == 2 else rng.randint(1, max_r)
        prompts.append([rng.randint(3, 90) for _ in range(lp)])
        responses.append([rng.randint(3, 90) for _ in range(lr - 1)] + [EOS] if lr else [])
    return prompts, responses


# ------------------------------------------------------------------------------------------------
# the rule, checked by brute force on the attention graph


def reachable(attn: torch.Tensor) -> torch.Tensor:
    """[T, T] bool: column k influences row q's output through any number of layers (transitive closure
    of the attention mask, which always includes the diagonal)."""
    r = attn.clone()
    while True:
        nxt = (r.float() @ r.float()) > 0
        if torch.equal(nxt, r):
            return r
        r = nxt


def check_rule(x, batch) -> int:
    """The spec's rule for every labelled row of every example: the label's true token is nowhere the
    row can see, and a mask row sees no clean token at the position of any mask it sees (no key computed
    from a masked token's true value). Returns the number of labels checked."""
    checked = 0
    for b in range(x.input_ids.shape[0]):
        R = reachable(x.attn_mask[b, 0])
        ids, pos, lab = x.input_ids[b], x.position_ids[b], x.labels[b]
        real = ~x.pad[b]
        clean = real & (ids != MASK)
        Lp = int(batch.prompt_len[b])
        for q in range(ids.shape[0]):
            if lab[q] == X:
                continue
            checked += 1
            seen = R[q] & real
            target = int(pos[q]) if ids[q] == MASK else int(pos[q]) + 1
            assert target >= Lp, "a label must be a response token"
            assert int(batch.response_ids[b, target - Lp]) == int(lab[q]), "label is the token at its position"
            clean_pos = set(pos[seen & clean].tolist())
            assert target not in clean_pos, f"row {q} sees its own label's token"
            if ids[q] == MASK:
                masked_pos = set(pos[seen & (ids == MASK)].tolist())
                assert not (masked_pos & clean_pos), f"mask row {q} sees a masked token's true value"
    return checked


@pytest.mark.parametrize("kind,seed", [("paper", 0), ("boundary", 1), ("ar-share:0.5", 2), ("draft", 3), ("draft", 4),
                                       ("hybrid", 5), ("joint-hybrid", 6), ("joint-hybrid", 7)])
def test_every_layout_keeps_the_rule_on_random_batches(kind, seed):
    prompts, responses = random_examples(random.Random(seed), 10, 6, 30)
    batch = make_batch(prompts, responses, PAD)
    if kind == "draft":
        x = draft_inputs(batch, MASK, gen(seed), slot_sizes=(1, 3, 4, 8))
    elif kind == "hybrid":
        x = hybrid_inputs(batch, MASK, gen(seed), slot_sizes=(2, 3, 5))
    elif kind == "joint-hybrid":
        x = joint_hybrid_inputs(batch, MASK, gen(seed), slot_sizes=(1, 2, 3, 5))
    else:
        v = parse_variant(kind)
        x = refusion_inputs(batch, MASK, gen(seed), slot_sizes=(2, 3, 5), boundary=v.boundary, ar_share=v.ar_share)
    assert check_rule(x, batch) > 50


def test_rule_checker_catches_a_leak():
    """The checker is not vacuous: a draft layout whose masks may see the whole response fails it."""
    batch = make_batch([[10, 11]], [[20, 21, 22, EOS]], PAD)
    x = draft_inputs(batch, MASK, gen(0), slot_sizes=(2,))
    x.attn_mask[0, 0, 6:, :6] = True  # the masks see every clean column
    with pytest.raises(AssertionError, match="sees its own label"):
        check_rule(x, batch)


# ------------------------------------------------------------------------------------------------
# hand-built layouts


def test_boundary_labels_hand_built():
    """Prompt [10, 11], response [20..24, EOS] in slots of 2; seed drawn so that slot 0 is clean and fed
    after slot 1, slot 2 masked: the boundary labels are prompt end -> 20, and slot 0's last token -> 22
    (slot 1 was fed before it: no label there), slot 1's last token -> 24 (slot 2 is masked)."""
    batch = make_batch([[10, 11]], [[20, 21, 22, 23, 24, EOS]], PAD)
    for seed in range(200):
        g = gen(seed)
        torch.randint(1, (1,), generator=g)
        p = (1 - 1e-3) * torch.rand(1, generator=g) + 1e-3
        u, keys = torch.rand(1, 3, generator=g), torch.rand(1, 3, generator=g)
        if (u[0] < p).tolist() == [False, False, True] and keys[0, 1] < keys[0, 0]:
            break
    paper = refusion_inputs(batch, MASK, gen(seed), slot_sizes=(2,))
    x = refusion_inputs(batch, MASK, gen(seed), slot_sizes=(2,), boundary=True)
    assert x.input_ids.tolist() == paper.input_ids.tolist() == [[10, 11, 22, 23, 20, 21, MASK, MASK]]
    assert paper.labels.tolist() == [[X, X, 23, X, 21, X, 24, EOS]]
    # 11 -> 20 (prompt end); 23 -> 24 (slot 2 masked); 21 -> 22? slot 1 was fed earlier: never
    assert x.labels.tolist() == [[X, 20, 23, 24, 21, X, 24, EOS]]


def test_ar_share_one_is_exactly_next_token_training():
    prompts, responses = random_examples(random.Random(5), 12, 8, 40)
    batch = make_batch(prompts, responses, PAD)
    x = refusion_inputs(batch, MASK, gen(9), slot_sizes=(4, 8, 16, 32), boundary=True, ar_share=1.0)
    a = ar_inputs(batch)
    for f in ("input_ids", "position_ids", "labels", "pad"):
        assert torch.equal(getattr(x, f), getattr(a, f)), f
    assert not x.is_masked.any()


def test_ar_share_zero_draws_what_the_paper_draws():
    prompts, responses = random_examples(random.Random(6), 12, 8, 40)
    batch = make_batch(prompts, responses, PAD)
    a = refusion_inputs(batch, MASK, gen(3))
    b = refusion_inputs(batch, MASK, gen(3), boundary=True)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.is_masked, b.is_masked)
    assert ((a.labels == b.labels) | (a.labels == X)).all()  # boundary only adds labels
    assert (b.labels != X).sum() > (a.labels != X).sum()
    with pytest.raises(ValueError, match="boundary"):
        refusion_inputs(batch, MASK, gen(3), ar_share=0.5)


def test_draft_layout_hand_built():
    """Prompt [10, 11], response [20, 21, 22, EOS], blocks of 2 at phase 1: blocks start at response
    index 0 ({0}), 1 ({1, 2}) and 3 ({3})."""
    batch = make_batch([[10, 11]], [[20, 21, 22, EOS]], PAD)
    for seed in range(100):
        g = gen(seed)
        torch.randint(1, (1,), generator=g)
        if int(torch.rand(1, generator=g) * 2) == 1:
            break
    x = draft_inputs(batch, MASK, gen(seed), slot_sizes=(2,))
    assert x.input_ids.tolist() == [[10, 11, 20, 21, 22, EOS, MASK, MASK, MASK, MASK]]
    assert x.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 2, 3, 4, 5]]
    assert x.labels.tolist() == [[X, 20, 21, 22, EOS, X, 20, 21, 22, EOS]]
    assert x.is_masked.tolist() == [[False] * 6 + [True] * 4]
    assert x.attention == "custom" and x.mask_rate.tolist() == [1.0]
    sees = [[k for k in range(10) if x.attn_mask[0, 0, q, k]] for q in range(10)]
    assert sees[:6] == [list(range(q + 1)) for q in range(6)]  # causal
    assert sees[6] == [0, 1, 6]  # mask at r0: the prompt only
    assert sees[7] == [0, 1, 2, 7]  # block {1, 2}: the prompt and r0
    assert sees[8] == [0, 1, 2, 7, 8]
    assert sees[9] == [0, 1, 2, 3, 4, 9]  # block {3}


def test_hybrid_layout_is_the_arms_example_then_the_papers_layout():
    prompts, responses = random_examples(random.Random(8), 9, 6, 20)
    batch = make_batch(prompts, responses, PAD)
    x = hybrid_inputs(batch, MASK, gen(4), slot_sizes=(2, 3))
    paper, arm = refusion_inputs(batch, MASK, gen(4), slot_sizes=(2, 3)), ar_inputs(batch)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n, Lr = len(p) + len(r), len(r)
        for f in ("input_ids", "position_ids", "labels", "is_masked"):
            got, a, pp = getattr(x, f)[b].tolist(), getattr(arm, f)[b].tolist(), getattr(paper, f)[b].tolist()
            assert got[:n] == a[:n] and got[n:n + Lr] == pp[len(p):n], f
        assert x.pad[b].tolist() == [False] * (n + Lr) + [True] * (x.pad.shape[1] - n - Lr)
        sees = x.attn_mask[b, 0]
        for q in range(n, n + Lr):  # a paper row: the prompt, and the paper part up to itself
            assert [k for k in range(x.pad.shape[1]) if sees[q, k]] == list(range(len(p))) + list(range(n, q + 1))
    assert torch.equal(x.mask_rate, paper.mask_rate)


def test_joint_hybrid_layout_is_the_draft_layout_then_the_papers_layout():
    prompts, responses = random_examples(random.Random(8), 9, 6, 20)
    batch = make_batch(prompts, responses, PAD)
    x = joint_hybrid_inputs(batch, MASK, gen(4), slot_sizes=(2, 3))
    g = gen(4)  # the same draws, in the same order
    draft = draft_inputs(batch, MASK, g, slot_sizes=(2, 3))
    paper = refusion_inputs(batch, MASK, g, slot_sizes=(2, 3))
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n, Lr = len(p) + 2 * len(r), len(r)
        for f in ("input_ids", "position_ids", "labels", "is_masked"):
            got, d, pp = getattr(x, f)[b].tolist(), getattr(draft, f)[b].tolist(), getattr(paper, f)[b].tolist()
            assert got[:n] == d[:n] and got[n:n + Lr] == pp[len(p):len(p) + Lr], f
        assert x.pad[b].tolist() == [False] * (n + Lr) + [True] * (x.pad.shape[1] - n - Lr)
        sees = x.attn_mask[b, 0]
        assert torch.equal(sees[:n, :n], draft.attn_mask[b, 0, :n, :n]) and not sees[:n, n:].any()
        for q in range(n, n + Lr):  # a paper row: the prompt, and the paper part up to itself
            assert [k for k in range(x.pad.shape[1]) if sees[q, k]] == list(range(len(p))) + list(range(n, q + 1))
        # the draft masks' p is 1, the paper's masks' p the paper's
        assert x.mask_rate[b, :n].tolist() == [1.0] * n
        assert x.mask_rate[b, n:n + Lr].tolist() == [paper.mask_rate[b].item()] * Lr
    # the MDM term: the draft masks' mean CE per example plus the paper's sum / p / Lr
    logits = torch.randn(*x.input_ids.shape, 100, generator=gen(5))
    loss, st = refusion_loss(logits, x, batch.response_len)
    ce = F.cross_entropy(logits.transpose(1, 2), x.labels.clamp(min=0), reduction="none")
    mdm = 0.0
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(p) + 2 * len(r)
        m = x.is_masked[b] & (x.labels[b] != X)
        draft_part = ce[b, :n][m[:n]].sum()
        paper_part = ce[b, n:][m[n:]].sum() / paper.mask_rate[b]
        mdm += (draft_part + paper_part) / max(len(r), 1)
    assert st["mdm_loss"].item() == pytest.approx((mdm / len(prompts)).item(), rel=1e-5)
    ar_cols = (x.labels != X) & ~x.is_masked
    assert st["ar_loss"].item() == pytest.approx((ce[ar_cols].sum() / ar_cols.sum()).item(), rel=1e-5)


def test_draft_layout_padding_and_empty_rows():
    batch = make_batch([[10], [], [12, 13]], [[20, EOS], [21, EOS], []], PAD)
    x = draft_inputs(batch, MASK, gen(0), slot_sizes=(4,))
    assert x.input_ids.shape == (3, 5)
    assert x.input_ids.tolist() == [[10, 20, EOS, MASK, MASK], [21, EOS, MASK, MASK, PAD], [12, 13, PAD, PAD, PAD]]
    assert x.labels.tolist() == [[20, EOS, X, 20, EOS], [EOS, X, 21, EOS, X], [X] * 5]
    assert x.pad.tolist() == [[False] * 5, [False] * 4 + [True], [False] * 2 + [True] * 3]
    assert all(x.attn_mask[b, 0].diagonal().all() for b in range(3))


def test_draft_loss_is_next_token_mean_plus_mask_mean_per_example():
    batch = make_batch([[10, 11], [12]], [[20, 21, EOS], [22, EOS]], PAD)
    x = draft_inputs(batch, MASK, gen(1), slot_sizes=(2,))
    logits = torch.randn(2, x.input_ids.shape[1], 100, generator=gen(2))
    loss, stats = refusion_loss(logits, x, batch.response_len)
    ce = F.cross_entropy(logits.transpose(1, 2), x.labels.clamp(min=0), reduction="none")
    ar_cols = (x.labels != X) & ~x.is_masked
    ar = ce[ar_cols].sum() / ar_cols.sum()  # 3 + 2 next-token labels
    mask = sum(ce[b][x.is_masked[b]].sum() / int(batch.response_len[b]) for b in range(2)) / 2
    assert int(ar_cols.sum()) == 5
    assert stats["ar_loss"].item() == pytest.approx(ar.item(), rel=1e-6)
    assert stats["mdm_loss"].item() == pytest.approx(mask.item(), rel=1e-6)
    assert loss.item() == pytest.approx((ar + mask).item(), rel=1e-6)
    # mask_loss_weight: the mask term weighed, the logged terms as they were
    w_loss, w_stats = loss_from_ce("refusion", ce, x, batch.response_len, mask_weight=3.0)
    assert w_loss.item() == pytest.approx((ar + 3 * mask).item(), rel=1e-6)
    assert w_stats["mdm_loss"].item() == pytest.approx(mask.item(), rel=1e-6)
    assert w_stats["ar_loss"].item() == pytest.approx(ar.item(), rel=1e-6)


# ------------------------------------------------------------------------------------------------
# configuration


def test_parse_variant():
    assert parse_variant("paper") == Variant()
    assert parse_variant("ar-share:0.25") == Variant("ar-share", 0.25)
    assert parse_variant("ar-share:0.25").boundary and parse_variant("joint").drafts
    for bad, msg in (("papr", "unknown objective variant"), ("ar-share", "ar-share:F"), ("ar-share:2", r"\(0, 1\]"),
                     ("joint:3", "takes no argument")):
        with pytest.raises(ConfigError, match=msg):
            parse_variant(bad)


def test_train_config_checks_variants():
    TrainConfig(variant="decoupled", mask_adapter={"rank": 4}).validate()
    with pytest.raises(ConfigError, match="variant of the refusion objective"):
        TrainConfig(objective="ar", variant="joint").validate()
    with pytest.raises(ConfigError, match="mask_adapter sizes the decoupled"):
        TrainConfig(variant="joint", mask_adapter={"rank": 4}).validate()
    with pytest.raises(ConfigError, match="rank must be an integer"):
        TrainConfig(variant="decoupled", mask_adapter={"rank": 0}).validate()
    with pytest.raises(ConfigError, match="does not combine with lora"):
        TrainConfig(variant="decoupled", lora={"r": 4}).validate()
    TrainConfig(variant="joint", mask_loss_weight=3.0).validate()
    for bad, msg in ((dict(mask_loss_weight=0.0), "finite number > 0"),
                     (dict(mask_loss_weight=float("nan")), "finite number > 0"),
                     (dict(objective="ar", mask_loss_weight=2.0), "has none"),
                     (dict(variant="decoupled", mask_loss_weight=2.0), "AdamW undoes it")):
        with pytest.raises(ConfigError, match=msg):
            TrainConfig(**bad).validate()
