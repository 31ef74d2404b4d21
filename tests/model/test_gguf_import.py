"""GGUF -> Hugging Face import: a synthetic llama GGUF round-trips exactly (fast); SmolLM2's real GGUF
matches transformers' own GGUF loader and tokenizer, and answers a question (slow: 93 MB download)."""

import json
import time

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from refusion.model.gguf import import_gguf, import_smollm2
from refusion.model.fetch import smollm2_gguf_file

# ---- fast: synthetic GGUF ---------------------------------------------------------------------------

TOKENS = ["<|endoftext|>", "<|im_start|>", "a", "b", "c", "Ġ", "ab", "abc", "Ġa"]
MERGES = ["a b", "ab c", "Ġ a"]
TINY = dict(vocab_size=len(TOKENS), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
            rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=0, pad_token_id=0)
GGUF_NAMES = {  # HF name (in model.layers.{i}.) -> llama.cpp name (in blk.{i}.)
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows: per head, (2, d/2) -> (d/2, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def write_tiny_gguf(path, sd: dict[str, torch.Tensor], arch: str = "llama") -> None:
    c = TINY
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3] + [1] * (len(TOKENS) - 2))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(c["bos_token_id"])
    w.add_eos_token_id(c["eos_token_id"])
    w.add_pad_token_id(c["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}")
    for name, t in sd.items():
        if name.endswith("q_proj.weight"):
            t = llamacpp_permute(t, c["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            t = llamacpp_permute(t, c["num_key_value_heads"])
        w.add_tensor(gguf_name(name), t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def tiny(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped norm is noticed
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(1.0, 0.5)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    write_tiny_gguf(tmp_path / "tiny.gguf", sd)
    return tmp_path / "tiny.gguf", sd


def test_synthetic_gguf_round_trips_exactly(tiny, tmp_path):
    path, sd = tiny
    out = import_gguf(path, tmp_path / "hf")
    ours = load_file(out / "model.safetensors")
    assert ours.keys() == sd.keys()
    for k, v in sd.items():  # q/k included: the un-permutation recovers what HF had
        assert torch.equal(ours[k], v), k
    cfg = json.loads((out / "config.json").read_text())
    for k, v in TINY.items():
        assert cfg[k] == v, k
    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()  # transformers reads the directory
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    ref.load_state_dict(sd)
    with torch.no_grad():
        assert torch.equal(hf(x).logits, ref(x).logits)


def test_synthetic_tokenizer(tiny, tmp_path):
    out = import_gguf(tiny[0], tmp_path / "hf")
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    # "abc" merges all the way; " ab" is Ġ a b, where "a b" outranks "Ġ a"; the control token stays whole.
    assert tok.encode("abc ab<|endoftext|>").ids == [7, 5, 6, 0]
    assert tok.decode([7, 5, 6, 0], skip_special_tokens=False) == "abc ab<|endoftext|>"
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|im_start|>", "<|endoftext|>", "<|endoftext|>")
    assert cfg["chat_template"].startswith("{% for m in messages %}")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == dict(bos_token_id=1, eos_token_id=0, pad_token_id=0)


def test_output_dir_must_be_empty_unless_overwrite(tiny, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        import_gguf(tiny[0], out)
    assert (out / "keep.txt").exists() and not any(p.name.startswith(".hf.tmp") for p in tmp_path.iterdir())
    import_gguf(tiny[0], out, dtype=torch.bfloat16, overwrite=True)
    assert not (out / "keep.txt").exists()
    assert load_file(out / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist; pass the path of a llama.cpp .gguf"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        import_gguf(f, tmp_path / "out")
    f.write_bytes(b"GGUF\x03\x00\x00\x00truncated")
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        import_gguf(f, tmp_path / "out")
    with pytest.raises(ValueError, match="is a directory, not a GGUF file"):
        import_gguf(tmp_path, tmp_path / "out")


def test_other_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="holds a 'qwen3' model; only 'llama'"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out")


# ---- slow: SmolLM2-135M-Instruct (Q4_1) -----------------------------------------------------------------

TEXTS = [
    "Hello world!", "The year 2024 had 366 days; 3.14159 is pi.", "  leading spaces and trailing   ",
    "line one\nline two\n\n\ttabbed\r\n", "naïve café, Ångström, 日本語のテキスト, emoji 🙂👍🏽",
    "def f(x):\n    return x ** 2  # square\n", "I'm sure they'll say it's fine, don't you think?",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    gguf_path = smollm2_gguf_file()
    t = time.perf_counter()
    out = import_smollm2(tmp_path_factory.mktemp("smollm2") / "hf")
    print(f"\nimport_smollm2: {time.perf_counter() - t:.1f} s")
    return gguf_path, out


@pytest.mark.slow
def test_state_dict_matches_transformers_gguf_loader(smol):
    gguf_path, out = smol
    ref = transformers.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ref_sd = ref.state_dict()
    ours = load_file(out / "model.safetensors")
    assert ours.keys() == ref_sd.keys() - {"lm_head.weight"}  # tied: transformers lists lm_head as embed_tokens
    for k, v in ours.items():
        assert v.shape == ref_sd[k].shape and (v - ref_sd[k]).abs().max() <= 1e-6, k
    ours_cfg, ref_cfg = transformers.AutoConfig.from_pretrained(out), ref.config
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
              "eos_token_id", "pad_token_id", "rope_parameters"):
        assert getattr(ours_cfg, k) == getattr(ref_cfg, k), k
    assert ours_cfg.rms_norm_eps == pytest.approx(ref_cfg.rms_norm_eps, rel=1e-6)


@pytest.mark.slow
def test_tokenizer_matches_transformers_gguf_tokenizer(smol):
    gguf_path, out = smol
    ref = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours = transformers.AutoTokenizer.from_pretrained(out)
    raw = HFTokenizer.from_file(str(out / "tokenizer.json"))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == prompt
    for text in TEXTS + [prompt]:
        ids = ref.encode(text)
        assert ours.encode(text) == ids == raw.encode(text).ids, text
        assert ours.decode(ids) == ref.decode(ids)
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert len(ours) == len(ref) == 49152


@pytest.mark.slow
def test_tokenizer_splits_digits_like_llamacpp_smollm(smol):
    # llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) isolate digits before GPT-2's
    # regex, so a run of spaces before a digit stays one piece. transformers' GGUF tokenizer uses GPT-2's
    # regex alone here and gives ["a", "Ġ", "Ġ", "1"]; everywhere else the two agree (test above).
    raw = HFTokenizer.from_file(str(smol[1] / "tokenizer.json"))
    assert raw.encode("a  1").tokens == ["a", "ĠĠ", "1"]


@pytest.mark.slow
def test_greedy_answer_mentions_paris(smol):
    out = smol[1]
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=20, do_sample=False)
    answer = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"\nanswer: {answer!r}")
    assert "Paris" in answer


@pytest.mark.slow
def test_refusion_itself_answers_paris_and_matches_transformers_logits(smol):
    from refusion.model.checkpoint import load_model
    from refusion.decoding import decode
    from refusion.model.tokenizer import Tokenizer

    out = smol[1]
    model, tok = load_model(out), Tokenizer.from_dir(out)
    ids = tok.chat_prompt_ids("What is the capital of France?")
    res = decode(model, [ids], "ar", gen_length=20)[0]
    answer = tok.decode(res.tokens)
    print(f"\nrefusion answer: {answer!r} ({len(res.tokens)} tokens, finished={res.finished})")
    assert "Paris" in answer and res.finished
    ref = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([ids + res.tokens])
    pos = torch.arange(x.shape[1])[None]
    with torch.no_grad():
        want = ref(input_ids=x, position_ids=pos).logits
        diff = (model(x, pos) - want).abs().max().item()
    print(f"max |logit difference| vs transformers LlamaForCausalLM: {diff:.2e}")
    # float32 rounding, relative to the logits' size: here (max |logit| 38) transformers' own float32 logits
    # are 9.3e-5 from its float64 ones and ours 1.3e-4, so a fixed 1e-4 failed on rounding alone
    assert diff < 1e-5 * want.abs().max().item()
