"""Batches that pay on a CPU: a batch of rows of different feed widths computes only its real tokens.

Counted at the embedding (every per-token operation of a forward, from the embedding to the LM head,
runs on the same tokens): the tokens a batch-8 decode computes are the tokens its rows were fed
(DecodeResult.tokens_fed), not the batch times the widest row's width.
"""

import functools
from pathlib import Path

import pytest

from refusion.model.checkpoint import load_model
from refusion.decoding import decode
from refusion.tasks import get_task
from refusion.model.tokenizer import Tokenizer

FIXTURE = Path(__file__).parents[1] / "fixtures" / "refusion-words"

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def fixture():
    return load_model(FIXTURE)


class TokenCounter:
    """Per forward: (tokens computed, batch x width of the feed)."""

    def __init__(self, model) -> None:
        self.computed, self.grid = [], []
        self._hooks = [model.register_forward_pre_hook(self._feed),
                       model.embed_tokens.register_forward_pre_hook(self._embed)]

    def _feed(self, module, args) -> None:
        self.grid.append(args[0].numel())

    def _embed(self, module, args) -> None:
        self.computed.append(args[0].numel())

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


@pytest.mark.parametrize("decoder,params", [
    ("speculative", dict(gen_length=48)),
    ("refusion", dict(gen_length=48, slot_size=8)),
    ("ar", dict(max_new_tokens=48)),
    # MDM counts a running row's prompt padding as fed (its tokens_fed is recorded so); it computes less
    ("mdm-threshold", dict(gen_length=32, block_length=16, threshold=0.9, prefix_cache=True)),
])
def test_a_batch_of_8_computes_only_its_real_tokens(decoder, params):
    m = fixture()
    tok = Tokenizer.from_dir(FIXTURE)
    prompts = [tok.chat_prompt_ids(ex.prompt) for name in ("sort", "add", "repeat")
               for ex in get_task(name).load("test", n=3, seed=5)][:8]
    assert len({len(p) for p in prompts}) > 1  # ragged from the prompts on
    count = TokenCounter(m)
    try:
        res = decode(m, prompts, decoder, **params)
    finally:
        count.remove()
    fed = sum(r.tokens_fed for r in res)
    assert len(count.computed) == len(count.grid)  # one embedding per forward
    if decoder.startswith("mdm"):
        assert sum(count.computed) < fed
    else:
        assert sum(count.computed) == fed
    assert sum(count.grid) > fed  # padded to the widest, the batch would have computed more
