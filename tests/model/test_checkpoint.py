"""Hugging Face directories: the published ReFusion layout, round-trips, mask token, bad input."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from refusion.model.checkpoint import CheckpointError, add_mask_token, load_model, save_model
from refusion.model.config import ModelConfig
from refusion.decoding import decode
from refusion.model.transformer import Transformer
from refusion.model.tokenizer import Tokenizer

from tests.conftest import BEGIN_ID, IM_END, MASK_ID, QWEN3_VOCAB, write_qwen3_tokenizer


def test_published_layout_loads_with_mask_and_tokenizer(refusion_layout_dir):
    model = load_model(refusion_layout_dir, require_mask=True)
    cfg = model.config
    assert (cfg.model_type, cfg.vocab_size, cfg.mask_token_id, cfg.eos_ids) == ("qwen3", QWEN3_VOCAB, MASK_ID, [IM_END])
    tok = Tokenizer.from_dir(refusion_layout_dir)
    assert tok.mask_id == MASK_ID and tok.token_id("<|beginoftext|>") == BEGIN_ID and tok.eos_id == IM_END
    hf_tok = transformers.AutoTokenizer.from_pretrained(refusion_layout_dir)
    text = "Natalia sold 48 clips in April, and half as many in May. 你好 <|mask|><|mask|>\n  x=1"
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.encode("<|mask|>") == [MASK_ID]
    for msgs in ([{"role": "user", "content": "What is 2+3?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]):
        ours = tok.apply_chat_template(msgs, add_generation_prompt=True)
        ref = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert ours == ref
    ids = tok.chat_prompt_ids("What is 2+3?")
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    # same logits as transformers on the published layout
    hf = transformers.AutoModelForCausalLM.from_pretrained(refusion_layout_dir).eval()
    x = torch.tensor([ids + [MASK_ID] * 4])
    pos = torch.arange(x.shape[1])[None]
    with torch.no_grad():
        torch.testing.assert_close(model(x, pos), hf(input_ids=x, position_ids=pos).logits, atol=1e-5, rtol=0)
    out = decode(model, [ids], "ar", gen_length=5)[0]
    assert len(out.tokens) >= 1 and out.positions[0] == len(ids)


def test_save_is_readable_by_transformers_and_keeps_the_tokenizer(refusion_layout_dir, tmp_path):
    model = load_model(refusion_layout_dir)
    tok = Tokenizer.from_dir(refusion_layout_dir)
    save_model(model, tmp_path / "copy", tokenizer=tok, dtype=torch.bfloat16)
    files = {p.name for p in (tmp_path / "copy").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json"} <= files
    assert json.loads((tmp_path / "copy" / "config.json").read_text())["mask_token_id"] == MASK_ID
    back = load_model(tmp_path / "copy")
    assert back.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(back.lm_head.weight, model.lm_head.weight.bfloat16(), atol=0, rtol=0)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "copy")
    assert hf_tok.convert_tokens_to_ids("<|mask|>") == MASK_ID
    assert Tokenizer.from_dir(tmp_path / "copy").mask_id == MASK_ID


def test_save_is_atomic_and_refuses_to_clobber(tmp_path):
    m = Transformer(ModelConfig(vocab_size=30, hidden_size=16, intermediate_size=32, num_layers=1,
                                num_heads=2, num_kv_heads=1)).init_weights(seed=0)
    save_model(m, tmp_path / "ck")
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        save_model(m, tmp_path / "ck")

    class Boom(Exception):
        pass

    class BadTok:
        def save(self, path):
            raise Boom()

    before = (tmp_path / "ck" / "model.safetensors").read_bytes()
    with pytest.raises(Boom):
        save_model(m.init_weights(seed=1), tmp_path / "ck", tokenizer=BadTok(), overwrite=True)
    # the old checkpoint is untouched and no temporary directory is left behind
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    save_model(m, tmp_path / "ck", overwrite=True)
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() != before


@pytest.mark.parametrize("value, what", [(float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "inf")])
def test_non_finite_weights_are_refused_when_loaded_naming_the_tensor(tmp_path, value, what):
    cfg = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1)
    m = Transformer(cfg).init_weights(seed=0)
    save_model(m, tmp_path / "ok")
    load_model(tmp_path / "ok")  # finite: loads
    with torch.no_grad():
        m.layers[1].self_attn.qkv_proj.weight[-1, 2] = value  # the last rows of the fused q/k/v: v_proj's
        m.norm.weight[0] = value  # a later tensor: the first is named
    save_model(m, tmp_path / "bad")
    with pytest.raises(CheckpointError, match=f"model.layers.1.self_attn.v_proj.weight holds {what} values"):
        load_model(tmp_path / "bad")


def test_weights_past_float16s_range_are_refused_in_float16(tmp_path):
    cfg = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    m = Transformer(cfg).init_weights(seed=0)
    with torch.no_grad():
        m.embed_tokens.weight[0, 0] = 1e6  # finite in float32, inf in float16
    save_model(m, tmp_path / "big")
    load_model(tmp_path / "big")
    with pytest.raises(CheckpointError, match="model.embed_tokens.weight holds inf values"):
        load_model(tmp_path / "big", dtype="float16")


@pytest.mark.parametrize("shape", [
    dict(),  # qwen3: q/k norms, tied
    dict(model_type="qwen2", qk_norm=False, qkv_bias=True, tie_word_embeddings=False),
    dict(model_type="llama", qk_norm=False, qkv_bias=True, o_bias=True, head_dim=12, num_kv_heads=1),
    dict(mask_token_id=39, mask_adapter={"rank": 3}),
])
def test_parameter_count_from_the_config_is_the_models(shape):
    from refusion.model.size import parameter_count
    from refusion.runtime import count_parameters

    cfg = ModelConfig(**{**dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                                num_kv_heads=2), **shape})
    with torch.device("meta"):
        assert parameter_count(cfg) == count_parameters(Transformer(cfg))


@pytest.mark.parametrize("shape", [
    dict(),
    dict(head_dim=12, tie_word_embeddings=False, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(mask_token_id=39, mask_adapter={"rank": 3}),
])
def test_a_model_built_on_meta_has_the_real_ones_tensors_and_computes_nothing(tmp_path, shape):
    """load_model builds on "meta": every parameter and buffer of a model built anywhere else, by name,
    shape and dtype, and no arithmetic (which there imports torch._dynamo: seconds of every start)."""
    cfg = ModelConfig(**{**dict(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                                num_kv_heads=2), **shape})
    with torch.device("meta"):
        meta = Transformer(cfg)
    real = Transformer(cfg)
    tensors = lambda m: {k: (v.shape, v.dtype) for k, v in [*m.named_parameters(), *m.named_buffers()]}
    assert tensors(meta) == tensors(real) and all(v.is_meta for v in meta.state_dict().values())
    save_model(real.init_weights(seed=0), tmp_path / "m")
    code = (f"import sys; from refusion.model.checkpoint import load_model; load_model({str(tmp_path / 'm')!r}); "
            "print('torch._dynamo' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=10**12, intermediate_size=10**12), "parameters at 4 bytes"),
    (dict(max_position_embeddings=10**12), "1,000,000,000,000 positions of RoPE table"),
])
def test_a_model_larger_than_the_machine_is_refused_before_allocating(tmp_path, change, message):
    cfg = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    save_model(Transformer(cfg).init_weights(seed=0), tmp_path / "m")
    c = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**c, **change}))
    with pytest.raises(CheckpointError, match=f"the model {tmp_path}/m/config.json describes needs about .*{message}.* "
                                              "more than this machine's .* of memory"):
        load_model(str(tmp_path / "m"))  # (a path as a string, as most callers give it)


def test_add_mask_token_grows_vocab_and_keeps_old_logits(tmp_path):
    tok_dir = tmp_path / "tok"
    write_qwen3_tokenizer(tok_dir, extra_tokens=())
    tok = Tokenizer.from_dir(tok_dir)
    n = len(tok)
    cfg = ModelConfig(vocab_size=n, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, tie_word_embeddings=False)
    m = Transformer(cfg).init_weights(seed=0).eval()
    ids, pos = torch.tensor([[100, 200, 300]]), torch.arange(3)[None]
    with torch.no_grad():
        before = m(ids, pos)
    mask_id = add_mask_token(m, tok)
    assert mask_id == n and m.config.mask_token_id == n and m.config.vocab_size == n + 1
    assert tok.mask_id == n and tok.encode("<|mask|>") == [n]
    with torch.no_grad():
        after = m(ids, pos)
        torch.testing.assert_close(after[..., :n], before, atol=1e-6, rtol=0)
        torch.testing.assert_close(m.embed_tokens.weight[n], m.embed_tokens.weight[:n].mean(0))
    # calling it again is a no-op on the vocabulary
    assert add_mask_token(m, tok) == n and m.config.vocab_size == n + 1
    save_model(m, tmp_path / "ck", tokenizer=tok)
    assert load_model(tmp_path / "ck", require_mask=True).config.mask_token_id == n


def test_add_mask_token_refuses_the_models_own_special_ids(tmp_path):
    from refusion.model.checkpoint import check_mask_token
    from refusion.training.data import train_bpe_tokenizer

    tok = train_bpe_tokenizer(["the cat sat on the mat"] * 10, vocab_size=270)
    word = tok.token_id("a")
    for field in ("eos_token_id", "bos_token_id", "pad_token_id"):
        cfg = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                          num_kv_heads=1, **{field: word})  # an ordinary word the config gives a role
        with pytest.raises(CheckpointError, match=f"'a' is the {field[:-9]} token \\(id {word}\\)"):
            check_mask_token(cfg, tok, "a", force=True)
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, eos_token_id=tok.eos_id)
    check_mask_token(cfg, tok, "a", force=True)  # forced, an ordinary word with no role is taken
    check_mask_token(cfg, tok)  # the tokenizer's own unused <|mask|> is fine
    m = Transformer(cfg).init_weights(seed=0)
    assert add_mask_token(m, tok) == tok.mask_id and m.config.causal_first_token


def test_add_mask_token_uses_a_padded_row_when_there_is_one(tmp_path):
    tok_dir = tmp_path / "tok"
    write_qwen3_tokenizer(tok_dir, extra_tokens=("<|beginoftext|>",))
    tok = Tokenizer.from_dir(tok_dir)
    cfg = ModelConfig(vocab_size=QWEN3_VOCAB, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=1)
    m = Transformer(cfg).init_weights(seed=0)
    assert add_mask_token(m, tok) == MASK_ID  # the published id
    assert m.config.vocab_size == QWEN3_VOCAB


def _broken(tmp_path, refusion_layout_dir, edit):
    d = tmp_path / "broken"
    shutil.copytree(refusion_layout_dir, d)
    edit(d)
    return d


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
    (lambda d: [p.unlink() for p in d.glob("model*.safetensors*")], "has no model.safetensors"),
    (lambda d: next(d.glob("model-00001-*.safetensors")).unlink(), "shard .* is missing"),
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})),
     "unsupported architecture 'GPT2LMHeadModel'"),
    (lambda d: (d / "config.json").write_text(json.dumps(
        {**json.loads((d / "config.json").read_text()), "hidden_size": 64})), "has shape .* config.json implies"),
    (lambda d: (d / "config.json").write_text("{not json"), "is not valid JSON"),
    (lambda d: (d / "config.json").write_text(json.dumps(
        {k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "mask_token_id"})),
     "no mask_token_id"),
] + [(lambda d, k=k, v=v: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), k: v})),
      f"{k} must be a token id.* " + re.escape(f"in [0, 151936), got {v}"))
     for k, v in [("eos_token_id", -7), ("eos_token_id", [151645, 151936]), ("bos_token_id", 200000),
                  ("pad_token_id", -1), ("mask_token_id", 151936)]])
def test_bad_checkpoints_give_one_line_errors(tmp_path, refusion_layout_dir, edit, message):
    d = _broken(tmp_path, refusion_layout_dir, edit)
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(d, require_mask=True)
    assert "\n" not in str(e.value)


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
