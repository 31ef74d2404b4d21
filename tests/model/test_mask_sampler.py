"""The masks' sampler (model/mask_sampler.py, training/mask_sampler.py): its chain against a row-by-row
reference, an untrained one drafting the argmax, the file round trip and its refusals, the decoder
feeding the chain while every output stays AR's, its features by hand, and a training that learns a
rule the argmax cannot know."""

import json

import pytest
import torch

from refusion.decoding import ARParams
from refusion.decoding import speculative as spec
from refusion.decoding.speculative import SpeculativeParams, generate_speculative
from refusion.model.config import ModelConfig
from refusion.model.mask_adapter import add_mask_adapter
from refusion.model.mask_sampler import MASK_SAMPLER, MaskSampler, read_sampler, sampler_of, save_sampler
from refusion.model.transformer import Transformer
from refusion.training.data import Example
from refusion.training.mask_sampler import SamplerTraining, chain_lengths, example_features, train_sampler
from tests.helpers.reference_ar import generate_ar

MASK = 23
CFG = dict(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
           mask_token_id=MASK, eos_token_id=1)
PROMPTS = [[2, 3, 4, 5, 6, 7, 2, 3], [8, 9, 10, 11, 8, 9], [12, 13]]


def adapted_model(seed: int = 3) -> Transformer:
    model = Transformer(ModelConfig(**CFG)).init_weights(seed=seed, std=0.5)
    add_mask_adapter(model, {"rank": 2}, gen=torch.Generator().manual_seed(seed))
    with torch.no_grad():  # adapters of some effect, so that the masks draft something
        for name, p in model.named_parameters():
            if ".mask_adapter." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return model.eval()


def random_sampler(hidden: int, candidates: int = 4, seed: int = 0) -> MaskSampler:
    s = MaskSampler(hidden, width=8, candidates=candidates)
    with torch.no_grad():
        for p in s.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + p.numel())))
    return s.eval()


def reference_chain(s: MaskSampler, model: Transformer, states, logits, first) -> list[list[int]]:
    """The chain row by row and mask by mask, written out."""
    out = []
    for b in range(states.shape[0]):
        row, prev = [int(first[b])], int(first[b])
        for i in range(1, states.shape[1]):
            cand = logits[b, i].topk(s.candidates).indices
            scores = s(states[b, i][None], model.embed_tokens.weight[prev][None], model.lm_head.weight[cand][None])[0]
            prev = int(cand[int(scores.argmax())])
            row.append(prev)
        out.append(row)
    return out


def test_the_chain_is_the_row_by_row_reference_and_an_untrained_sampler_drafts_the_argmax():
    model = adapted_model()
    g = torch.Generator().manual_seed(1)
    states, logits = torch.randn(3, 5, 32, generator=g), torch.randn(3, 5, 24, generator=g)
    first = torch.tensor([4, 0, 17])
    s = random_sampler(32)
    with torch.no_grad():
        got = s.draft(model, states, logits, first)
        assert got.tolist() == reference_chain(s, model, states, logits, first)
        # (the chain depends on the token before: another first token changes what follows somewhere)
        assert s.draft(model, states, logits, first + 1)[:, 1:].tolist() != got[:, 1:].tolist()
        # zero `up`: scores are the LM head's own logits of the candidates, so the argmax
        fresh = MaskSampler(32, width=8, candidates=4).eval()
        h = torch.randn(3, 5, 32, generator=g)
        lg = torch.nn.functional.linear(h, model.lm_head.weight)
        assert fresh.draft(model, h, lg, first)[:, 1:].tolist() == lg[:, 1:].argmax(-1).tolist()


def test_the_file_round_trips_and_a_wrong_one_is_refused(tmp_path):
    s = random_sampler(32, candidates=6)
    path = save_sampler(s, tmp_path)
    assert path == tmp_path / MASK_SAMPLER and not list(tmp_path.glob("*.tmp"))
    back = read_sampler(path, hidden_size=32)
    assert (back.hidden_size, back.width, back.candidates) == (32, 8, 6) and not back.training
    for k, v in s.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)
    with pytest.raises(ValueError, match="hidden size 32, but the model's is 64"):
        read_sampler(path, hidden_size=64)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="is not a mask sampler"):
        read_sampler(tmp_path / "junk.safetensors")


def test_a_model_finds_the_sampler_kept_beside_it(tmp_path):
    model = adapted_model()
    assert sampler_of(model) is None  # loaded from nowhere
    other = adapted_model()
    other.directory = tmp_path
    kept = random_sampler(32)
    save_sampler(kept, tmp_path)
    found = sampler_of(other)
    assert isinstance(found, MaskSampler) and sampler_of(other) is found  # read once
    assert all(torch.equal(found.state_dict()[k], v) for k, v in kept.state_dict().items())


@pytest.mark.parametrize("lookup,redraft,width", [(False, False, 4), (True, False, 4), (False, True, 4),
                                                  (False, False, 12)])
def test_speculative_feeds_the_chain_and_every_output_stays_ar(monkeypatch, lookup, redraft, width):
    """With a sampler the masks' drafts a row holds after a fully accepted step (with redraft blocks,
    after any step) are the chain from the step's extra token (not the masks' argmax), every mask of
    the block, and greedy output is AR's whatever the sampler drafts, at batch 1 and ragged batch 3;
    with sampler=False the sampler is never asked."""
    model = adapted_model()
    s = random_sampler(32)
    monkeypatch.setattr(spec, "sampler_of", lambda m: s)
    chains, held, redrafts = [], [], []
    draft = MaskSampler.draft

    def spy(self, m, states, logits, first):
        out = draft(self, m, states, logits, first)
        chains.append((out.tolist(), logits.argmax(-1).tolist()))
        return out

    monkeypatch.setattr(MaskSampler, "draft", spy)
    advance = spec.SpeculativeSeq.advance

    def watch(self, j, extra, mask_preds, redrafted=None, branch=None, **kw):  # (branch: a forking row's)
        k = self.fed_k
        advance(self, j, extra, mask_preds, redrafted, branch, **kw)
        if j == k and not self.done and mask_preds:
            held.append((extra, list(mask_preds)))
        elif redrafted and not self.done:
            held.append((extra, [extra] + list(redrafted)))
            redrafts.append(held[-1])

    monkeypatch.setattr(spec.SpeculativeSeq, "advance", watch)
    for prompts in (PROMPTS[:1], PROMPTS):
        want = generate_ar(model, prompts, ARParams(gen_length=40), eos_ids=[])
        p = SpeculativeParams(gen_length=40, lookup=lookup, widths="fixed", draft_length=width, redraft=redraft)
        got = generate_speculative(model, prompts, p, eos_ids=[])
        assert [r.tokens for r in got] == [r.tokens for r in want]
    assert chains and held
    assert bool(redrafts) == redraft  # (rows kept redrafted blocks: they are checked with the rest)
    # every block the rows kept after a full accept is a chain the sampler drew, starting at the extra token
    drawn = [row for rows, _ in chains for row in rows]
    assert max(map(len, drawn)) == width + 1
    assert all(any(row[:len(preds)] == [extra] + preds[1:] for row in drawn) for extra, preds in held)
    # and the chain is not the argmax (else the test would not tell them apart)
    assert any(rows != amax for rows, amax in chains)
    chains.clear()
    off = generate_speculative(model, PROMPTS, SpeculativeParams(gen_length=40, lookup=lookup, sampler=False),
                               eos_ids=[])
    assert not chains and [r.tokens for r in off] == [r.tokens for r in want]


def test_features_by_hand():
    """example_features: at cut c, mask i (1..block-1) is labelled response[c + i] and follows
    response[c + i - 1] (the prompt's last token before response[0]); past the end: -1. Its state is
    the forward's normed final state and its candidates that state's top logits."""
    model = adapted_model()
    ex = Example(prompt=[2, 3, 4], response=[5, 6, 7, 8, 9])
    f = example_features(model, ex, [0, 3], block=4, candidates=3)
    assert f["truth"].tolist() == [[6, 7, 8], [9, -1, -1]]
    assert f["prev"].tolist() == [[5, 6, 7], [8, 9, -1]]
    assert f["states"].shape == (2, 3, 32) and f["candidates"].shape == (2, 3, 3)
    # the same masks through the forward directly: cut 3, masks at response positions 3..6
    with torch.no_grad():
        ids = torch.tensor([[2, 3, 4, 5, 6, 7, MASK, MASK, MASK, MASK]])
        pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
        logits, h = model(ids, pos, states=True)
    torch.testing.assert_close(f["states"][1].float(), h[0, 7:10].bfloat16().float())
    assert f["candidates"][1].tolist() == logits[0, 7:10].topk(3).indices.tolist()


def test_a_sampler_learns_what_the_argmax_cannot_know():
    """Synthetic features where each mask's token is a fixed function of the token before it, found
    among its candidates at a random place, while the states carry nothing: the argmax (candidate 0)
    is right a quarter of the time, the trained sampler nearly always; chain_lengths by hand."""
    model = adapted_model()
    g = torch.Generator().manual_seed(0)
    N, J, K = 600, 4, 4
    prev = torch.randint(2, 22, (N, J), generator=g)
    truth = (prev * 7) % 20 + 2
    cand = torch.empty(N, J, K, dtype=torch.long)
    for n in range(N):
        for j in range(J):
            others = [t for t in torch.randperm(20, generator=g).tolist() if t + 2 != truth[n, j]][:K - 1]
            row = [t + 2 for t in others]
            row.insert(int(torch.randint(K, (1,), generator=g)), int(truth[n, j]))
            cand[n, j] = torch.tensor(row)
    f = dict(states=torch.zeros(N, J, 32, dtype=torch.bfloat16), candidates=cand, truth=truth, prev=prev,
             example=torch.arange(N) // 3)
    assert chain_lengths(None, model, {k: v[:2] for k, v in f.items()}).tolist() == [
        int((truth[b] == cand[b, :, 0]).long().cumprod(0).sum()) for b in range(2)]
    cfg = SamplerTraining(steps=300, batch_size=256, lr=1e-2, check_every=100, candidates=K, width=64, dropout=0.0)
    s, record = train_sampler(model, f, cfg, progress=False)
    assert record["argmax_chain"] < 0.6 and record["best_chain"] > 3.0, record
    assert record["best_step"] in (100, 200, 300) and json.dumps(record)
