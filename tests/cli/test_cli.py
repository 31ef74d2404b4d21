"""The command line is a thin layer: exact ids in, JSON out; bad input is one line and exit code 2."""

import json
import subprocess
import sys

import pytest

from refusion.model.checkpoint import save_model
from refusion.cli import main
from refusion.model.config import ModelConfig
from refusion.decoding import decode
from refusion.model.transformer import Transformer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, mask_token_id=23, eos_token_id=1)
    path = tmp_path_factory.mktemp("cli") / "m"
    save_model(Transformer(cfg).init_weights(seed=0, std=0.5), path)
    return path


@pytest.mark.parametrize("decoder, flags, params", [
    ("refusion", ["--slot-size", "4", "--slot-threshold", "0.2", "--token-threshold", "0.1"],
     dict(slot_size=4, slot_threshold=0.2, token_threshold=0.1, serial_blocks=1)),
    ("refusion-l2r", ["--slot-size", "4", "--checks"], dict(slot_size=4, join_check=True, causal_infill=True,
                                                           recheck_rows=True)),
    ("ar", [], dict()),
    ("mdm", ["--block-length", "8", "--steps", "8"], dict(block_length=8, steps=8)),
    ("mdm-threshold", ["--block-length", "8", "--threshold", "0.3"], dict(block_length=8, threshold=0.3)),
    ("speculative", ["--draft-length", "3", "--accept-prob", "0.2"], dict(draft_length=3, accept_prob=0.2)),
])
def test_generate_json_equals_the_python_api(model_dir, capsys, decoder, flags, params):
    rc = main(["generate", "--model", str(model_dir), "--prompt-ids", "3,4,5", "--gen-length", "16",
               "--decoder", decoder, "--json", *flags])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    from refusion.model.checkpoint import load_model
    ref = decode(load_model(model_dir), [[3, 4, 5]], decoder, seed=0, gen_length=16, **params)[0]
    assert out["tokens"] == ref.tokens and out["positions"] == ref.positions and out["steps"] == ref.steps
    assert out["forwards"] == ref.forwards and out["decoder"] == decoder


def test_default_decoder_is_speculative_for_a_model_with_a_mask_token(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--prompt-ids", "3,4", "--gen-length", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decoder"] == "speculative"


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "{m}", "--prompt-ids", "3,4", "--gen-length", "10", "--decoder", "refusion",
      "--slot-size", "4"],
     "gen_length 10 must be a multiple of slot_size x serial_blocks = 4"),
    (["generate", "--model", "{m}", "--prompt-ids", "3,99"], "prompt token id 99 is outside the vocabulary [0, 24)"),
    (["generate", "--model", "{m}", "hello"], "has no tokenizer.json; use --prompt-ids"),
    (["generate", "--model", "{m}/missing", "--prompt-ids", "3"], "does not exist"),
    (["info", "{m}/missing"], "does not exist"),
])
def test_bad_input_is_one_line_and_exit_code_2(model_dir, argv, message):
    argv = [a.replace("{m}", str(model_dir)) for a in argv]
    p = subprocess.run([sys.executable, "-m", "refusion.cli", *argv], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [f"refusion: error: {p.stderr.strip().split('error: ', 1)[1]}"]
    assert message in p.stderr and "Traceback" not in p.stderr


def test_the_default_decoder_fits_the_training_objective_and_a_misfit_is_warned(tmp_path, capsys):
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      mask_token_id=23, eos_token_id=1, bidirectional=True, training_objective="mdm")
    save_model(Transformer(cfg).init_weights(seed=0, std=0.5), tmp_path / "mdm")
    argv = ["generate", "--model", str(tmp_path / "mdm"), "--prompt-ids", "3,4", "--gen-length", "8", "--json"]
    assert main(argv + ["--block-length", "8"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["decoder"] == "mdm-threshold" and err == ""
    assert main(argv + ["--decoder", "refusion", "--slot-size", "4"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("refusion: warning: this model was trained with the mdm objective, which decoder "
                          "'refusion' does not fit (fitting: mdm, mdm-threshold)")


def test_info_without_a_path_is_the_bundled_model_with_its_parameter_count(capsys):
    from refusion.model.checkpoint import load_model
    from refusion.bundled import BUNDLED

    assert main(["info"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["path"] == str(BUNDLED) and d["default_decoder"] == "speculative" and d["training_objective"] == "refusion"
    assert d["parameters"] == sum(p.numel() for p in load_model(BUNDLED).parameters()) > 500_000


def test_threads_default_to_one_for_a_small_model_and_follow_the_flag(model_dir, capsys):
    import torch

    n = torch.get_num_threads()
    try:
        argv = ["generate", "--model", str(model_dir), "--prompt-ids", "3,4", "--gen-length", "8", "--json"]
        torch.set_num_threads(2)
        assert main(argv) == 0 and torch.get_num_threads() == 1
        assert main(argv + ["--threads", "2"]) == 0 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


def test_every_flag_has_help_with_its_default():
    from refusion.cli.args import HelpFormatter
    from refusion.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    fmt = HelpFormatter("refusion")
    for name, p in sub.choices.items():
        for action in p._actions:
            if action.dest in ("help", "decoder_defaults"):
                continue
            assert action.help, f"refusion {name} {action.option_strings or action.dest} has no help"
            d = action.default
            if not (d is None or d is False or d == [] or d == "==SUPPRESS==") and action.option_strings:
                assert "default" in fmt._get_help_string(action), (name, action.dest)
    eval_help = sub.choices["eval"].format_help()
    assert "arith" in eval_help and "gsm8k" in eval_help  # --task lists the task names
    assert "lr = 0.001" in sub.choices["train"].format_help()  # train --help lists TrainConfig's defaults
    assert "0 = greedy (default: 0.0)" in sub.choices["generate"].format_help()


def test_after_add_mask_token_ar_and_speculative_answer_as_the_base_did(tmp_path, capsys):
    from refusion.model.checkpoint import load_config, load_model
    from refusion.model.tokenizer import Tokenizer
    from tests.helpers.tiny_causal_lm import make_causal_lm

    base = make_causal_lm(tmp_path / "base", std=0.3)
    masked = tmp_path / "masked"
    assert main(["add-mask-token", str(base), str(masked)]) == 0
    assert load_config(masked).causal_first_token and not load_config(base).causal_first_token

    def tokens(model, decoder):
        capsys.readouterr()
        assert main(["generate", "--model", str(model), "What is 3 plus 4?", "--decoder", decoder,
                     "--gen-length", "24", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    want = tokens(base, "ar")
    assert tokens(masked, "ar") == want
    assert tokens(masked, "speculative") == want
    # not vacuous: the first token read from the untrained mask (what ar did before) is another answer
    prompt = Tokenizer.from_dir(masked).chat_prompt_ids("What is 3 plus 4?")
    from_mask = decode(load_model(masked), [prompt], "ar", gen_length=24, first_from_mask=True)[0].tokens
    assert from_mask != want


def test_info_counts_the_parameters_of_a_config_too_large_to_build(model_dir, tmp_path, capsys):
    import shutil

    assert main(["info", str(model_dir)]) == 0
    small = json.loads(capsys.readouterr().out)["parameters"]
    shutil.copytree(model_dir, tmp_path / "huge")
    c = json.loads((tmp_path / "huge" / "config.json").read_text())
    (tmp_path / "huge" / "config.json").write_text(json.dumps({**c, "num_hidden_layers": 10**12}))
    assert main(["info", str(tmp_path / "huge")]) == 0
    out = json.loads(capsys.readouterr().out)
    per_layer = (small - 24 * 32 - 32) // 2  # (2 layers, tied 24 x 32 embeddings, the final norm)
    assert out["parameters"] == 24 * 32 + 32 + 10**12 * per_layer and out["num_layers"] == 10**12


def test_add_mask_token_takes_an_ordinary_word_only_when_forced(tmp_path, capsys):
    from refusion.model.checkpoint import load_model
    from refusion.training.data import train_bpe_tokenizer
    from refusion.model.tokenizer import Tokenizer

    tok = train_bpe_tokenizer(["the cat sat"] * 10, vocab_size=270)
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, eos_token_id=tok.eos_id)
    save_model(Transformer(cfg).init_weights(seed=0), tmp_path / "causal", tok)
    argv = ["add-mask-token", str(tmp_path / "causal"), str(tmp_path / "out"), "--token", "a"]
    assert main(argv) == 2 and "'a' is already token" in capsys.readouterr().err
    assert main(argv + ["--force"]) == 0
    a = Tokenizer.from_dir(tmp_path / "causal").token_id("a")
    assert load_model(tmp_path / "out").config.mask_token_id == a
    assert main(["add-mask-token", str(tmp_path / "causal"), str(tmp_path / "new")]) == 0  # <|mask|>: new, fine
    assert load_model(tmp_path / "new").config.mask_token_id == tok.mask_id  # the BPE carries an unused <|mask|>
