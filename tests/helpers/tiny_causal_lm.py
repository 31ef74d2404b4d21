"""A tiny causal LM directory shaped like SmolLM2's import (Llama layout, tied embeddings, a chat
template, no <|mask|>): the stand-in for a pretrained model in fast tests."""

import json
import random
from pathlib import Path

import pytest

from refusion.model.checkpoint import save_model
from refusion.model.config import ModelConfig
from refusion.model.tokenizer import Tokenizer
from refusion.model.transformer import Transformer
from refusion.training.data import train_bpe_tokenizer

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2}


def addition_records(n: int = 300, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    recs = []
    for _ in range(n):
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        recs.append({"query": f"What is {a} plus {b}?", "response": f"{a} + {b} = {a + b}. The answer is {a + b}."})
    return recs


def tokenizer_without_mask(texts: list[str], vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE of `texts` with ChatML tokens and no mask token (as a causal LM's)."""
    from tokenizers import Tokenizer as HF

    tok = train_bpe_tokenizer(texts, vocab_size=vocab_size)
    raw = json.loads(tok.tok.to_str())
    gone = tok.mask_id  # drop it and close the gap in the ids (merges refer to strings, not ids)
    raw["added_tokens"] = [dict(t, id=t["id"] - (t["id"] > gone)) for t in raw["added_tokens"] if t["id"] != gone]
    raw["model"]["vocab"] = {k: v - (v > gone) for k, v in raw["model"]["vocab"].items() if v != gone}
    cfg = {k: v for k, v in tok.config.items() if k != "mask_token"}
    return Tokenizer(HF.from_str(json.dumps(raw)), cfg)


def make_causal_lm(path: Path, seed: int = 1, std: float = 0.02) -> Path:
    """A random tiny Llama causal LM with a tokenizer of the addition records, saved at `path`."""
    tok = tokenizer_without_mask([r["query"] + r["response"] for r in addition_records()])
    n = max(tok.tok.get_vocab().values()) + 1
    cfg = ModelConfig(vocab_size=n, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, model_type="llama",
                      qk_norm=False, tie_word_embeddings=True, max_position_embeddings=1024, **SHAPE)
    save_model(Transformer(cfg).init_weights(std=std, seed=seed), path, tok)
    return path


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A module's tiny causal LM (make_causal_lm): import it into a test module to use it."""
    return make_causal_lm(tmp_path_factory.mktemp("base") / "base")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """The addition records as a {"query", "response"} JSONL file."""
    path = tmp_path_factory.mktemp("data") / "add.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in addition_records()))
    return path


def assert_clean_logits_are_the_bases(base, adapted, tok: Tokenizer) -> None:
    """A prompt followed by masks: the adapted model's clean rows' logits equal the base's bit for bit,
    its mask rows' do not (the adapter acted on them)."""
    import torch

    mask = adapted.config.mask_token_id
    ids = torch.tensor([tok.chat_prompt_ids("What is 3 plus 4?") + [mask] * 4])
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        a, b = base(ids, pos), adapted(ids, pos)
    clean = ids[0] != mask
    assert torch.equal(a[0, clean], b[0, clean]) and not torch.allclose(a[0, ~clean], b[0, ~clean])
