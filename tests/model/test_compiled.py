"""The compiled forward (refusion.model.compiled): close to eager for every cache, no recompiles as widths vary,
eager wherever it does not apply. Compiling takes seconds per graph, so the cases share a few graphs."""

import functools
from pathlib import Path

import pytest
import torch

from refusion.model.checkpoint import load_model
from refusion.model.compiled import enable_compile
from refusion.model.config import ModelConfig
from refusion.decoding import decode
from refusion.model.transformer import Transformer

FIXTURE = Path(__file__).parents[1] / "fixtures" / "refusion-words"

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def fixture():
    return load_model(FIXTURE)


def tiny() -> Transformer:
    cfg = ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      mask_token_id=39, eos_token_id=1)
    return Transformer(cfg).init_weights(seed=0, std=0.3).eval()


@torch.inference_mode()
def test_appending_cache_steps_match_eager():
    m = tiny()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 39, (2, 9), generator=g)
    eager, comp = m.new_cache(), m.new_cache()
    m(prompt, torch.arange(9).expand(2, 9), cache=eager)
    m(prompt, torch.arange(9).expand(2, 9), cache=comp)
    cf = enable_compile(m)
    for t, width in enumerate([1, 1, 3, 1, 2]):  # width 1 and width >= 2: two graphs
        ids = torch.randint(0, 39, (2, width), generator=g)
        pos = torch.arange(width).expand(2, width) + 9 + t * 3
        m.compiled = cf
        got = m(ids, pos, cache=comp, num_logits=1)
        m.compiled = None
        want = m(ids, pos, cache=eager, num_logits=1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert len(comp) == len(eager)
    n = len(eager)
    torch.testing.assert_close(comp.k[1][:, :, :n], eager.k[1][:, :, :n], atol=1e-4, rtol=0)
    assert cf.stats.compiled_calls == 5 and cf.stats.recompiles == 0 and cf.stats.graphs == 2


@torch.inference_mode()
def test_nothing_compiles_after_warm_up_as_widths_and_caches_grow():
    """Counted by dynamo itself. A warm-up decode per decoder at batch 1 and at batch 3 compiles the
    shape classes (which sizes are 1, what is left out); then decodes of other prompt lengths, whose
    feed widths change every step and whose caches are larger (AR's KVCache grows past its capacity
    in the middle of the decode), build no graph."""
    from torch._dynamo.utils import counters

    m = tiny()
    g = torch.Generator().manual_seed(1)

    def prompts(*lengths):
        return [torch.randint(2, 39, (n,), generator=g).tolist() for n in lengths]

    # adaptive widths: the cost policy's widths follow its acceptance pool and cost table, so which
    # shape classes it reaches (width 0 on one row left of three, say) depends on history; its own
    # check is below
    runs = [("speculative", dict(gen_length=24, widths="adaptive")), ("refusion", dict(gen_length=24, slot_size=4)),
            ("ar", dict(max_new_tokens=24))]
    stats = enable_compile(m).stats
    try:
        for decoder, params in runs:
            for batch in (prompts(5), prompts(5, 9, 12)):
                decode(m, batch, decoder, eos_ids=[], **params)
        graphs, calls = counters["stats"]["unique_graphs"], stats.compiled_calls
        for decoder, params in runs:  # 250 + 24 tokens: past the first capacity (cache.CAPACITY_STEP)
            for batch in (prompts(250), prompts(200, 7, 30)):
                decode(m, batch, decoder, eos_ids=[], **params)
        assert counters["stats"]["unique_graphs"] == graphs
        assert stats.recompiles == 0 and stats.compiled_calls - calls > 100
        # the cost policy may reach a new shape class, compiled once, but never compiles one again
        calls = stats.compiled_calls
        for batch in (prompts(5), prompts(5, 9, 12), prompts(250), prompts(200, 7, 30)):
            decode(m, batch, "speculative", eos_ids=[], gen_length=24)
        assert stats.recompiles == 0 and stats.compiled_calls - calls > 40
    finally:
        m.compiled = None


@pytest.mark.parametrize("decoder,params,same_classes", [
    # RaggedKVCache, widths changing every step: the cost policy's widths follow its acceptance pool,
    # which the first run leaves changed, so the second may reach a shape class of its own
    ("speculative", dict(gen_length=48), False),
    ("speculative", dict(gen_length=48, widths="adaptive"), True),
    ("refusion", dict(gen_length=48, slot_size=8), True),  # SlotKVCache, plan / verify / infill widths
    ("ar", dict(max_new_tokens=24), True),  # KVCache, batch with finished rows
])
def test_decoders_through_the_compiled_forward(decoder, params, same_classes):
    """On a trained model (no near-ties in these prompts) the outputs equal eager's, nothing is ever
    compiled twice, and with history-free widths the second run compiles no graph at all."""
    from refusion.tasks import get_task
    from refusion.model.tokenizer import Tokenizer

    m = fixture()
    tok = Tokenizer.from_dir(FIXTURE)
    prompts = [tok.chat_prompt_ids(ex.prompt) for name in ("sort", "add") for ex in get_task(name).load("test", n=2, seed=3)]
    m.compiled = None
    want = decode(m, prompts, decoder, **params)
    stats = enable_compile(m).stats
    try:
        got = decode(m, prompts, decoder, **params)
        graphs = stats.graphs
        again = decode(m, prompts[::-1], decoder, **params)
    finally:
        m.compiled = None
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.tokens for r in again] == [r.tokens for r in want[::-1]]
    assert stats.compiled_calls > 0 and stats.recompiles == 0
    if same_classes:
        assert stats.graphs == graphs  # the second run compiled nothing


@torch.inference_mode(False)
def test_eager_where_compiling_does_not_apply():
    m = tiny()
    stats = enable_compile(m, max_tokens=8).stats
    ids, pos = torch.tensor([[3, 4, 5]]), torch.arange(3)[None]
    m(ids, pos)  # gradients on (and no cache): eager
    with torch.inference_mode():
        m(ids, pos)  # no cache
        c = m.new_cache()
        m(ids, pos, cache=c)  # nothing cached yet: the prefill runs eager
        wide = m.new_cache()
        m(torch.arange(12)[None], torch.arange(12)[None], cache=wide)  # 12 tokens > max_tokens
        seen = []
        hook = m.layers[1].mlp.down_proj.register_forward_hook(lambda mod, i, o: seen.append(o.shape))
        m(torch.tensor([[6]]), torch.tensor([[3]]), cache=c)  # a hook inside a block: eager, and it runs
        hook.remove()
        assert seen == [(1, m.config.hidden_size)]
    assert stats.compiled_calls == 0 and stats.eager_calls == 4 and stats.graphs == 0


def adapted_tiny() -> Transformer:
    from refusion.model.mask_adapter import add_mask_adapter

    m = tiny()
    add_mask_adapter(m, {"rank": 4}, gen=torch.Generator().manual_seed(1))
    with torch.no_grad():  # an adapter that changes the mask rows (a fresh one starts at zero effect)
        for n, p in m.named_parameters():
            if n == "mask_embedding" or n.endswith("_B"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.3)
    return m.eval()


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["default", "max-autotune"])
def test_a_mask_adapter_runs_in_the_graph(mode):
    """Mask rows take the adapter's path inside the compiled graph, as in eager: feeds with no mask,
    one mask and several (masks last, each feed on the prompt's cache alone); the clean rows' logits
    are the base model's (close)."""
    m = adapted_tiny()
    base = tiny()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 39, (2, 9), generator=g)
    eager, comp, plain = m.new_cache(), m.new_cache(), base.new_cache()
    for model, cache in ((m, eager), (m, comp), (base, plain)):
        model(prompt, torch.arange(9).expand(2, 9), cache=cache)
    cf = enable_compile(m, mode=mode)
    for feed in [[5], [5, 39], [5, 39, 39, 39], [7, 8, 39, 39]]:
        ids = torch.tensor([feed, [3] * len(feed)])
        pos = torch.arange(len(feed)).expand(2, -1) + 9
        m.compiled = cf
        got = m(ids, pos, cache=comp)
        m.compiled = None
        want = m(ids, pos, cache=eager)
        clean = base(ids, pos, cache=plain)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        masks = ids == 39
        if masks.any():
            assert (got[masks] - clean[masks]).abs().max() > 1e-2  # the adapter did act on the masks
        torch.testing.assert_close(got[~masks], clean[~masks], atol=1e-4, rtol=0)
        for cache in (eager, comp, plain):
            cache.crop(9)
    assert cf.stats.compiled_calls == 4 and cf.stats.eager_calls == 0 and cf.stats.recompiles == 0


def test_an_unknown_compile_mode_is_refused():
    from refusion.cli.args import COMPILE_MODES
    from refusion.model.compiled import MODES

    assert COMPILE_MODES == MODES
    with pytest.raises(ValueError, match="compile mode must be one of default, max-autotune"):
        enable_compile(tiny(), mode="fast")
