"""Training objectives: exact layouts on hand-built cases, a slow per-example reference, losses against a
hand-summed reference, degenerate batches (all masked, empty responses), invariants on a big random batch."""

import math
import random
from dataclasses import fields

import pytest
import torch

from refusion.training.objectives import (Batch, TrainInputs, ar_inputs, ar_loss, build_inputs, compute_loss, make_batch,
                                 mdm_inputs, mdm_loss, refusion_inputs, refusion_loss)

MASK, PAD, EOS = 99, 0, 2
F_, T_ = False, True
X = -100


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def causal_expected(pad: list[list[bool]]) -> torch.Tensor:
    B, T = len(pad), len(pad[0])
    m = [[[(k <= q and not pad[b][k]) or k == q for k in range(T)] for q in range(T)] for b in range(B)]
    return torch.tensor(m)[:, None]


def bidir_expected(pad: list[list[bool]]) -> torch.Tensor:
    B, T = len(pad), len(pad[0])
    m = [[[(not pad[b][k]) or k == q for k in range(T)] for q in range(T)] for b in range(B)]
    return torch.tensor(m)[:, None]


# ------------------------------------------------------------------------------------------------
# hand-built exact layouts


def test_refusion_hand_built_layout():
    batch = make_batch([[10, 11, 12], [13]], [list(range(20, 30)) + [EOS], [30, 31, EOS]], PAD)
    seed = 67
    # re-draw in the documented order: R = 11, S = ceil(11 / 4) = 3
    g = gen(seed)
    size_idx = torch.randint(1, (2,), generator=g)
    t = torch.rand(2, generator=g)
    u = torch.rand(2, 3, generator=g)
    keys = torch.rand(2, 3, generator=g)
    p = (1 - 1e-3) * t + 1e-3
    assert size_idx.tolist() == [0, 0]
    # example 0: slot 0 = [20..23] masked, slots 1 = [24..27] and 2 = [28, 29, EOS] clean, slot 2 fed first
    assert (u[0] < p[0]).tolist() == [True, False, False]
    assert keys[0, 2] < keys[0, 1]
    # example 1: its only slot [30, 31, EOS] is clean
    assert not (u[1, 0] < p[1])

    x = refusion_inputs(batch, MASK, gen(seed), slot_sizes=(4,))
    assert x.input_ids.tolist() == [
        [10, 11, 12, 28, 29, EOS, 24, 25, 26, 27, MASK, MASK, MASK, MASK],
        [13, 30, 31, EOS, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD, PAD]]
    assert x.position_ids.tolist() == [
        [0, 1, 2, 11, 12, 13, 7, 8, 9, 10, 3, 4, 5, 6],
        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert x.labels.tolist() == [
        [X, X, X, 29, EOS, X, 25, 26, 27, X, 20, 21, 22, 23],
        [X, 31, EOS, X, X, X, X, X, X, X, X, X, X, X]]
    assert x.is_masked.tolist() == [
        [F_] * 10 + [T_] * 4,
        [F_] * 14]
    pad = [[F_] * 14, [F_] * 4 + [T_] * 10]
    assert x.pad.tolist() == pad
    assert torch.equal(x.mask_rate, p)
    assert x.slot_size.tolist() == [4, 4]
    assert x.attention is None
    assert x.attn_mask.shape == (2, 1, 14, 14) and x.attn_mask.dtype == torch.bool
    assert torch.equal(x.attn_mask, causal_expected(pad))


def test_refusion_hand_built_slot_size_draw():
    batch = make_batch([[7]], [[40, 41, 42, 43, 44, EOS]], PAD)
    seed = 41
    g = gen(seed)  # R = 6, S = ceil(6 / 2) = 3
    size_idx = torch.randint(2, (1,), generator=g)
    p = (1 - 1e-3) * torch.rand(1, generator=g) + 1e-3
    u = torch.rand(1, 3, generator=g)
    keys = torch.rand(1, 3, generator=g)
    assert size_idx.tolist() == [0]  # s = 2: slots [40, 41], [42, 43], [44, EOS]
    assert (u[0] < p[0]).tolist() == [False, True, False]
    assert keys[0, 2] < keys[0, 0]  # slot 2 fed before slot 0

    x = refusion_inputs(batch, MASK, gen(seed), slot_sizes=(2, 5))
    assert x.input_ids.tolist() == [[7, 44, EOS, 40, 41, MASK, MASK]]
    assert x.position_ids.tolist() == [[0, 5, 6, 1, 2, 3, 4]]
    assert x.labels.tolist() == [[X, EOS, X, 41, X, 42, 43]]
    assert x.is_masked.tolist() == [[F_, F_, F_, F_, F_, T_, T_]]
    assert x.slot_size.tolist() == [2]


def test_ar_hand_built_layout():
    batch = make_batch([[10, 11, 12], [13]], [[20, 21, EOS], [30, EOS]], PAD)
    x = ar_inputs(batch)
    assert x.input_ids.tolist() == [[10, 11, 12, 20, 21, EOS], [13, 30, EOS, PAD, PAD, PAD]]
    assert x.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert x.labels.tolist() == [[X, X, 20, 21, EOS, X], [30, EOS, X, X, X, X]]
    assert not x.is_masked.any()
    assert x.mask_rate.tolist() == [1.0, 1.0]
    pad = [[F_] * 6, [F_, F_, F_, T_, T_, T_]]
    assert x.pad.tolist() == pad
    assert x.attention is None
    assert torch.equal(x.attn_mask, causal_expected(pad))


def test_mdm_hand_built_layout():
    batch = make_batch([[10, 11, 12], [13]], [[20, 21, EOS], [30, EOS]], PAD)
    seed = 123
    g = gen(seed)
    p = (1 - 1e-3) * torch.rand(2, generator=g) + 1e-3
    u = torch.rand(2, 3, generator=g)
    masked = u < p[:, None]
    # example 1's third draw falls under p but lies past its response: it must not mask anything
    assert masked.tolist() == [[True, False, True], [False, True, True]]

    x = mdm_inputs(batch, MASK, gen(seed))
    assert x.input_ids.tolist() == [[10, 11, 12, MASK, 21, MASK], [13, 30, MASK, PAD, PAD, PAD]]
    assert x.position_ids.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert x.labels.tolist() == [[X, X, X, 20, X, EOS], [X, X, EOS, X, X, X]]
    assert x.is_masked.tolist() == [[F_, F_, F_, T_, F_, T_], [F_, F_, T_, F_, F_, F_]]
    assert torch.equal(x.mask_rate, p)
    pad = [[F_] * 6, [F_, F_, F_, T_, T_, T_]]
    assert x.attention == "bidirectional"
    assert torch.equal(x.attn_mask, bidir_expected(pad))


# ------------------------------------------------------------------------------------------------
# slow reference of the ReFusion layout, fed the same draws


def reference_refusion(prompts, responses, mask_id, pad_id, slot_sizes, eps, seed):
    B = len(prompts)
    R = max((len(r) for r in responses), default=0)
    S = math.ceil(R / min(slot_sizes))
    g = gen(seed)
    size_idx = torch.randint(len(slot_sizes), (B,), generator=g).tolist()
    p = ((1 - eps) * torch.rand(B, generator=g) + eps).tolist()
    u = torch.rand(B, S, generator=g).tolist()
    keys = torch.rand(B, S, generator=g).tolist()
    rows = []
    for b in range(B):
        prompt, resp, s = prompts[b], responses[b], slot_sizes[size_idx[b]]
        Lp = len(prompt)
        starts = list(range(0, len(resp), s))
        masked = [u[b][j] < p[b] for j in range(len(starts))]
        clean = sorted((j for j in range(len(starts)) if not masked[j]), key=lambda j: keys[b][j])
        ids, pos, lab, msk = list(prompt), list(range(Lp)), [X] * Lp, [False] * Lp
        for j in clean:
            st = starts[j]
            slot = resp[st:st + s]
            ids += slot
            pos += [Lp + st + k for k in range(len(slot))]
            lab += slot[1:] + [X]
            msk += [False] * len(slot)
        for j in range(len(starts)):
            if masked[j]:
                st = starts[j]
                slot = resp[st:st + s]
                ids += [mask_id] * len(slot)
                pos += [Lp + st + k for k in range(len(slot))]
                lab += slot
                msk += [True] * len(slot)
        rows.append((ids, pos, lab, msk))
    T = max(len(r[0]) for r in rows)
    out = dict(input_ids=[], position_ids=[], labels=[], is_masked=[], pad=[])
    for ids, pos, lab, msk in rows:
        n = len(ids)
        out["input_ids"].append(ids + [pad_id] * (T - n))
        out["position_ids"].append(pos + list(range(n, T)))
        out["labels"].append(lab + [X] * (T - n))
        out["is_masked"].append(msk + [False] * (T - n))
        out["pad"].append([False] * n + [True] * (T - n))
    return out, p


def random_examples(rng: random.Random, B: int, max_p: int, max_r: int, vocab=(3, 90)):
    prompts, responses = [], []
    for b in range(B):
        lp = 0 if b == 1 else rng.randint(1, max_p)  # one empty prompt
        lr = 0 if b % 5 == 2 else rng.randint(1, max_r)  # several empty responses
        prompts.append([rng.randint(*vocab) for _ in range(lp)])
        responses.append([rng.randint(*vocab) for _ in range(lr - 1)] + [EOS] if lr else [])
    return prompts, responses


@pytest.mark.parametrize("slot_sizes,eps,seed", [((4, 8, 16, 32), 1e-3, 0), ((1, 3, 5), 1e-3, 1), ((2,), 0.5, 2)])
def test_refusion_equals_slow_reference(slot_sizes, eps, seed):
    prompts, responses = random_examples(random.Random(seed), 16, 12, 70)
    batch = make_batch(prompts, responses, PAD)
    x = refusion_inputs(batch, MASK, gen(seed), slot_sizes=slot_sizes, eps=eps)
    ref, p = reference_refusion(prompts, responses, MASK, PAD, slot_sizes, eps, seed)
    for k, v in ref.items():
        assert getattr(x, k).tolist() == v, k
    assert x.mask_rate.tolist() == p
    assert torch.equal(x.attn_mask, causal_expected(ref["pad"]))


def test_layouts_deterministic_and_leave_global_rng_alone():
    prompts, responses = random_examples(random.Random(3), 8, 10, 40)
    batch = make_batch(prompts, responses, PAD)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    a = refusion_inputs(batch, MASK, gen(5))
    b = refusion_inputs(batch, MASK, gen(5))
    c = refusion_inputs(batch, MASK, gen(6))
    m1, m2 = mdm_inputs(batch, MASK, gen(5)), mdm_inputs(batch, MASK, gen(5))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert torch.equal(m1.input_ids, m2.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)


# ------------------------------------------------------------------------------------------------
# invariants on a big random batch


def test_refusion_invariants_big_batch():
    rng = random.Random(7)
    prompts, responses = random_examples(rng, 64, 40, 300)
    batch = make_batch(prompts, responses, PAD)
    x = refusion_inputs(batch, MASK, gen(11))
    T = x.input_ids.shape[1]
    assert T == max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    permuted = 0
    for b in range(64):
        prompt, resp, s = prompts[b], responses[b], int(x.slot_size[b])
        Lp, Lr = len(prompt), len(resp)
        ids, pos = x.input_ids[b].tolist(), x.position_ids[b].tolist()
        lab, msk = x.labels[b].tolist(), x.is_masked[b].tolist()
        n = Lp + Lr
        assert x.pad[b].tolist() == [False] * n + [True] * (T - n)
        assert ids[n:] == [PAD] * (T - n) and lab[n:] == [X] * (T - n) and pos[n:] == list(range(n, T))
        # every position id once; prompt first, in place, unlabelled
        assert sorted(pos[:n]) == list(range(n))
        assert ids[:Lp] == prompt and pos[:Lp] == list(range(Lp)) and lab[:Lp] == [X] * Lp
        # each response token sits at its own position (as itself, or as a mask labelled with it)
        got = []
        for c in range(Lp, n):
            i = pos[c] - Lp
            if msk[c]:
                assert ids[c] == MASK and lab[c] == resp[i]
                got.append(lab[c])
            else:
                assert ids[c] == resp[i]
                got.append(ids[c])
        assert sorted(got) == sorted(resp)  # multiset preserved
        # clean tokens first, then masked; masked in position order; whole slots masked or not
        n_clean = msk[Lp:n].count(False)
        assert msk[Lp:n] == [False] * n_clean + [True] * (Lr - n_clean)
        mpos = pos[Lp + n_clean:n]
        assert mpos == sorted(mpos)
        slot_of = {}
        for c in range(Lp, n):
            slot_of.setdefault((pos[c] - Lp) // s, set()).add(msk[c])
        assert all(len(v) == 1 for v in slot_of.values())
        # clean slots: contiguous, consecutive positions, full length, within-slot next-token labels
        c, order = Lp, []
        while c < Lp + n_clean:
            j = (pos[c] - Lp) // s
            assert pos[c] == Lp + j * s  # a slot starts at its first token
            k = min(s, Lr - j * s)
            assert pos[c:c + k] == list(range(pos[c], pos[c] + k))
            assert lab[c:c + k] == ids[c + 1:c + k] + [X]
            order.append(j)
            c += k
        assert len(set(order)) == len(order)
        permuted += order != sorted(order)
    assert permuted > 0  # the clean slots really are shuffled
    assert set(x.slot_size.tolist()) == {4, 8, 16, 32}


# ------------------------------------------------------------------------------------------------
# losses against a hand-summed reference


def ref_ce(row: list[float], label: int) -> float:
    m = max(row)
    return -(row[label] - m - math.log(sum(math.exp(v - m) for v in row)))


def reference_losses(logits, x, response_len):
    B, T, _ = logits.shape
    ar_sum, ar_n, mdm = 0.0, 0, 0.0
    for b in range(B):
        per = 0.0
        for c in range(T):
            lab = int(x.labels[b, c])
            if lab == X:
                continue
            ce = ref_ce(logits[b, c].double().tolist(), lab)
            if bool(x.is_masked[b, c]):
                per += ce / float(x.mask_rate[b])
            else:
                ar_sum += ce
                ar_n += 1
        Lr = int(response_len[b])
        mdm += per / Lr if Lr else 0.0
    return (ar_sum / ar_n if ar_n else 0.0), mdm / B


def test_refusion_loss_matches_reference():
    prompts, responses = random_examples(random.Random(9), 6, 5, 20)
    batch = make_batch(prompts, responses, PAD)
    x = refusion_inputs(batch, MASK, gen(4), slot_sizes=(2, 3))
    V = 100
    logits = torch.randn(*x.input_ids.shape, V, generator=gen(8)) * 3
    loss, st = refusion_loss(logits, x, batch.response_len)
    ar, mdm = reference_losses(logits, x, batch.response_len)
    assert st["n_ar_tokens"] > 0 and st["n_masked_tokens"] > 0  # both terms exercised
    assert st["ar_loss"].item() == pytest.approx(ar, rel=1e-5)
    assert st["mdm_loss"].item() == pytest.approx(mdm, rel=1e-5)
    assert loss.item() == pytest.approx(ar + mdm, rel=1e-5)
    assert int(st["n_ar_tokens"]) == int(((x.labels != X) & ~x.is_masked).sum())
    assert int(st["n_masked_tokens"]) == int(x.is_masked.sum())
    # bf16 logits are upcast: same result as the float32 CE of the rounded logits
    lb = logits.bfloat16()
    assert refusion_loss(lb, x, batch.response_len)[0].item() == pytest.approx(
        refusion_loss(lb.float(), x, batch.response_len)[0].item(), rel=1e-6)


def test_ar_and_mdm_loss_match_reference():
    prompts, responses = random_examples(random.Random(10), 6, 5, 20)
    batch = make_batch(prompts, responses, PAD)
    V = 100
    xa = ar_inputs(batch)
    la = torch.randn(*xa.input_ids.shape, V, generator=gen(1))
    ar, _ = reference_losses(la, xa, batch.response_len)
    assert ar_loss(la, xa)[0].item() == pytest.approx(ar, rel=1e-5)
    assert compute_loss("ar", la, xa, batch)[0].item() == pytest.approx(ar, rel=1e-5)
    xm = mdm_inputs(batch, MASK, gen(2))
    lm = torch.randn(*xm.input_ids.shape, V, generator=gen(3))
    ar0, mdm = reference_losses(lm, xm, batch.response_len)
    assert ar0 == 0.0 and mdm > 0
    assert mdm_loss(lm, xm, batch.response_len)[0].item() == pytest.approx(mdm, rel=1e-5)
    assert compute_loss("mdm", lm, xm, batch)[0].item() == pytest.approx(mdm, rel=1e-5)


# ------------------------------------------------------------------------------------------------
# degenerate batches


def test_all_masked_batch_has_zero_ar_term():
    prompts, responses = random_examples(random.Random(12), 8, 6, 30)
    batch = make_batch(prompts, responses, PAD)
    x = refusion_inputs(batch, MASK, gen(0), eps=1.0)  # p = 1: every slot masked
    assert x.mask_rate.tolist() == [1.0] * 8
    n_resp = int(batch.response_len.sum())
    assert int(x.is_masked.sum()) == n_resp
    logits = torch.randn(*x.input_ids.shape, 100, generator=gen(1), requires_grad=True)
    loss, st = refusion_loss(logits, x, batch.response_len)
    assert st["ar_loss"].item() == 0.0 and int(st["n_ar_tokens"]) == 0
    assert torch.isfinite(loss) and loss.item() > 0
    assert loss.item() == pytest.approx(reference_losses(logits.detach(), x, batch.response_len)[1], rel=1e-5)
    loss.backward()
    assert torch.isfinite(logits.grad).all()


def test_empty_response_contributes_zero():
    mixed = make_batch([[10, 11], [12, 13, 14]], [[20, 21, 22, 23, 24, EOS], []], PAD)
    x = refusion_inputs(mixed, MASK, gen(3), slot_sizes=(2,))
    # the empty example is its prompt and padding only, with no label
    assert x.input_ids[1].tolist() == [12, 13, 14, PAD, PAD, PAD, PAD, PAD]
    assert x.labels[1].tolist() == [X] * 8 and not x.is_masked[1].any()
    logits = torch.randn(2, 8, 50, generator=gen(4))
    loss, st = refusion_loss(logits, x, mixed.response_len)
    assert torch.isfinite(loss)
    # same as row 0 alone, with the MDM term halved (B = 2)
    row0 = TrainInputs(**{f.name: (v[:1] if isinstance(v := getattr(x, f.name), torch.Tensor) else v)
                          for f in fields(x)})
    _, sf = refusion_loss(logits[:1], row0, mixed.response_len[:1])
    assert int(sf["n_ar_tokens"]) > 0 and int(sf["n_masked_tokens"]) > 0
    assert st["ar_loss"].item() == pytest.approx(sf["ar_loss"].item(), rel=1e-6)
    assert st["mdm_loss"].item() == pytest.approx(sf["mdm_loss"].item() / 2, rel=1e-6)
    for name in ("ar", "mdm"):
        xi = build_inputs(name, mixed, MASK, gen(3))
        assert torch.isfinite(compute_loss(name, torch.randn(2, 8, 50), xi, mixed)[0])


@pytest.mark.parametrize("name", ["refusion", "ar", "mdm"])
def test_all_empty_responses_give_zero_loss(name):
    batch = make_batch([[10, 11], [12]], [[], []], PAD)
    assert batch.response_ids.shape == (2, 0)
    x = build_inputs(name, batch, MASK, gen(0))
    assert x.input_ids.tolist() == [[10, 11], [12, PAD]]
    assert (x.labels == X).all()
    logits = torch.randn(2, 2, 30, requires_grad=True)
    loss, _ = compute_loss(name, logits, x, batch)
    assert loss.item() == 0.0
    loss.backward()
    assert (logits.grad == 0).all()


def test_pad_rows_of_attn_mask_never_empty():
    batch = make_batch([[10], [11, 12, 13]], [[EOS], [20, 21, EOS]], PAD)
    for name in ("refusion", "ar", "mdm"):
        m = build_inputs(name, batch, MASK, gen(0)).attn_mask
        assert m.any(-1).all()
        assert m[0, 0, 2, 2] and m[0, 0, 3, 3]  # pad rows see themselves
        assert not m[0, 0, 0, 2:].any() and not m[0, 0, 1, 2:].any()  # real rows never see pad keys


# ------------------------------------------------------------------------------------------------
# validation


def test_validation_errors():
    batch = make_batch([[10]], [[20, EOS]], PAD)
    with pytest.raises(ValueError, match="unknown objective"):
        build_inputs("gpt", batch, MASK, gen(0))
    with pytest.raises(ValueError, match="unknown objective"):
        compute_loss("gpt", torch.zeros(1, 3, 5), ar_inputs(batch), batch)
    with pytest.raises(ValueError, match="empty"):
        refusion_inputs(batch, MASK, gen(0), slot_sizes=())
    with pytest.raises(ValueError, match="positive"):
        refusion_inputs(batch, MASK, gen(0), slot_sizes=(4, 0))
    with pytest.raises(ValueError, match="positive"):
        build_inputs("refusion", batch, MASK, gen(0), slot_sizes=(-2,))
    with pytest.raises(ValueError, match="eps"):
        mdm_inputs(batch, MASK, gen(0), eps=1.5)
    with pytest.raises(ValueError, match="prompts"):
        make_batch([[1]], [], PAD)
    assert isinstance(batch, Batch)


def test_pad_responses_with_eos_llada_style():
    from refusion.training.objectives import pad_responses

    b = make_batch([[1, 2], [3]], [[5, 6, 9], [7, 9]], pad_id=0)
    p = pad_responses(b, eos_id=9, length=4)
    assert p.response_ids.tolist() == [[5, 6, 9, 9], [7, 9, 9, 9]] and p.response_len.tolist() == [4, 4]
    q = pad_responses(b, eos_id=9, length=2)  # longer responses are never cut
    assert q.response_ids.tolist() == [[5, 6, 9], [7, 9, 0]] and q.response_len.tolist() == [3, 2]
    inp = mdm_inputs(p, mask_id=4, gen=torch.Generator().manual_seed(0))
    assert inp.input_ids.shape == (2, 6) and not inp.pad[:, :5].any()
