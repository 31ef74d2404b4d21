"""The command line is a thin layer: exact ids in, JSON out; bad input is one line and exit code 2."""

import json
import subprocess
import sys

import pytest

from refusion.checkpoint import save_model
from refusion.cli import main
from refusion.config import ModelConfig
from refusion.decoding import decode
from refusion.model import Transformer


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
    ("refusion-l2r", ["--slot-size", "4", "--recompute-kv"], dict(slot_size=4, recompute_kv=True)),
    ("ar", [], dict()),
    ("mdm", ["--block-length", "8", "--steps", "8"], dict(block_length=8, steps=8)),
    ("mdm-threshold", ["--block-length", "8", "--threshold", "0.3", "--prefix-cache"],
     dict(block_length=8, threshold=0.3, prefix_cache=True)),
])
def test_generate_json_equals_the_python_api(model_dir, capsys, decoder, flags, params):
    rc = main(["generate", "--model", str(model_dir), "--prompt-ids", "3,4,5", "--gen-length", "16",
               "--decoder", decoder, "--json", *flags])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    from refusion.checkpoint import load_model
    ref = decode(load_model(model_dir), [[3, 4, 5]], decoder, seed=0, gen_length=16, **params)[0]
    assert out["tokens"] == ref.tokens and out["positions"] == ref.positions and out["steps"] == ref.steps
    assert out["forwards"] == ref.forwards and out["decoder"] == decoder


def test_default_decoder_is_refusion_for_a_model_with_a_mask_token(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--prompt-ids", "3,4", "--gen-length", "8",
                 "--slot-size", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decoder"] == "refusion"


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "{m}", "--prompt-ids", "3,4", "--gen-length", "10", "--slot-size", "4"],
     "gen_length 10 must be a multiple of slot_size x serial_blocks = 4"),
    (["generate", "--model", "{m}", "--prompt-ids", "3,99"], "prompt ids must lie in [0, 24)"),
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
