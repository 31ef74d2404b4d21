"""A model's decoding.json: read and written exactly, checked on the way in, and the start of every
way of decoding the model (decode(), the command line), with what the caller gives winning."""

import json
import os

import pytest

from refusion import bundled
from refusion.cli import main
from refusion.decoding import decode, model_settings
from refusion.decoding.model_settings import ModelSettings
from refusion.decoding.params import GUARDS, ReFusionParams
from refusion.model.checkpoint import load_model, save_model
from refusion.model.config import ModelConfig
from refusion.model.transformer import Transformer

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10]]
FIXED3 = {"widths": "fixed", "draft_length": 3, "mask_length": 2}

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny() -> Transformer:
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, mask_token_id=23, eos_token_id=1, max_position_embeddings=64)
    return Transformer(cfg).init_weights(seed=0, std=0.5).eval()


@pytest.fixture
def model_dir(tmp_path):
    save_model(tiny(), tmp_path / "m")
    return tmp_path / "m"


def outcome(results):
    return [(r.tokens, r.positions, r.steps, r.forwards, r.tokens_fed) for r in results]


def test_written_settings_read_back_the_same_and_leave_no_temporary_file(model_dir):
    s = ModelSettings("speculative", {"fork": True, "width_price": 0.25}, measured_by="python x.py", note="n")
    model_settings.write(model_dir, s)
    assert model_settings.read(model_dir) == s
    assert not [p for p in os.listdir(model_dir) if p.startswith(".decoding-")]
    assert model_settings.read(model_dir.parent) is None  # no file: no settings


@pytest.mark.parametrize("body, says", [
    ({"decoder": "nope", "params": {}}, "unknown decoder 'nope'"),
    ({"decoder": "speculative", "params": {"slot_size": 8}}, "does not take slot_size"),
    ({"decoder": "speculative", "params": {"width_price": 2.0}}, "width_price must be a number in (0, 1]"),
    ({"decoder": "speculative", "params": {}, "colour": "red"}, "unknown key(s) colour"),
    (["speculative"], "must be a JSON object"),
])
def test_a_bad_file_is_refused_naming_it_and_what_is_wrong(model_dir, body, says):
    (model_dir / model_settings.FILE).write_text(json.dumps(body))
    with pytest.raises(ValueError) as e:
        model_settings.read(model_dir)
    assert says in str(e.value) and str(model_dir / model_settings.FILE) in str(e.value)


def test_resolve_the_callers_parameters_win_and_another_decoder_drops_the_files():
    s = ModelSettings("speculative", {"fork": True, "draft_length": 8})
    config = tiny().config
    assert model_settings.resolve(s, config, None, {}) == ("speculative", {"fork": True, "draft_length": 8})
    assert model_settings.choose(ModelSettings("ar"), config) == "ar"
    assert model_settings.choose(ModelSettings("ar"), config, "mdm") == "mdm"
    assert model_settings.resolve(s, config, None, {"draft_length": 2}) == ("speculative",
                                                                            {"fork": True, "draft_length": 2})
    assert model_settings.resolve(s, config, "ar", {"gen_length": 4}) == ("ar", {"gen_length": 4})
    assert model_settings.resolve(None, config, None, {}) == ("speculative", {})  # the objective's default
    no_mask = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                          num_kv_heads=2)
    assert model_settings.resolve(None, no_mask, None, {})[0] == "ar"


def test_decode_on_a_loaded_model_starts_from_its_settings(model_dir):
    model_settings.write(model_dir, ModelSettings("speculative", FIXED3))
    loaded = load_model(model_dir)
    want = outcome(decode(tiny(), PROMPTS, "speculative", eos_ids=[], gen_length=20, **FIXED3))
    assert outcome(decode(loaded, PROMPTS, eos_ids=[], gen_length=20)) == want
    # the default alone drafts otherwise (so the comparison above could fail)
    assert outcome(decode(tiny(), PROMPTS, "speculative", eos_ids=[], gen_length=20)) != want
    # a parameter given wins over the file's
    assert outcome(decode(loaded, PROMPTS, eos_ids=[], gen_length=20, draft_length=1)) == outcome(
        decode(tiny(), PROMPTS, "speculative", eos_ids=[], gen_length=20, **dict(FIXED3, draft_length=1)))
    # the file is read again when it changes
    model_settings.write(model_dir, ModelSettings("ar", {}))
    assert decode(loaded, PROMPTS, eos_ids=[], gen_length=20)[0].forwards == 20


def test_generate_runs_the_models_settings_and_a_flag_wins(model_dir, capsys):
    model_settings.write(model_dir, ModelSettings("speculative", FIXED3))
    want = decode(tiny(), [[3, 4, 5]], "speculative", gen_length=20, **FIXED3)[0]
    assert main(["generate", "--prompt-ids", "3,4,5", "--model", str(model_dir), "--gen-length", "20", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["decoder"], got["tokens"], got["forwards"]) == ("speculative", want.tokens, want.forwards)
    one = decode(tiny(), [[3, 4, 5]], "speculative", gen_length=20, **dict(FIXED3, draft_length=1))[0]
    assert main(["generate", "--prompt-ids", "3,4,5", "--model", str(model_dir), "--gen-length", "20",
                 "--draft-length", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["forwards"] == one.forwards != want.forwards


@pytest.mark.parametrize("flag, says", [
    (["--fork"], "--fork is no longer a flag: fork is a Python-only setting"),
    (["--width-price", "0.25"], "--width-price is no longer a flag: width_price is a Python-only setting"),
    (["--fixed-widths"], 'decode(..., widths="fixed")'),
    (["--no-sampler"], "decode(..., sampler=False)"),
    (["--join-check"], "--join-check is now part of --checks"),
    (["--recheck-rows"], "--recheck-rows is now part of --checks"),
])
def test_a_removed_flag_ends_in_one_line_naming_what_replaces_it(model_dir, flag, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt-ids", "3,4,5", "--model", str(model_dir), *flag])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and err.count("\n") == 1


def test_checks_is_the_three_guards_together():
    p = ReFusionParams(gen_length=16, slot_size=4, checks=True)
    assert all(getattr(p, g) for g in GUARDS)
    assert not any(getattr(ReFusionParams(gen_length=16, slot_size=4), g) for g in GUARDS)
    with pytest.raises(ValueError, match="checks .* need temperature 0"):
        ReFusionParams(gen_length=16, slot_size=4, checks=True, temperature=0.5)
    model = tiny()
    both = dict(gen_length=16, slot_size=4, slot_threshold=0.1, token_threshold=0.1)
    assert outcome(decode(model, PROMPTS, "refusion", eos_ids=[], checks=True, **both)) == outcome(
        decode(model, PROMPTS, "refusion", eos_ids=[], **{g: True for g in GUARDS}, **both))


def test_an_adapted_model_takes_its_adapters_settings_and_follows_their_changes(tmp_path):
    assert bundled.DECODING_SETTINGS == model_settings.FILE
    adapter, out = tmp_path / "adapter", tmp_path / "out"
    adapter.mkdir()
    out.mkdir()
    model_settings.write(adapter, ModelSettings("speculative", {"fork": True}))
    bundled._sync_settings(adapter, out)
    assert model_settings.read(out) == ModelSettings("speculative", {"fork": True})
    model_settings.write(adapter, ModelSettings("speculative", {"width_price": 0.5}))
    bundled._sync_settings(adapter, out)
    assert model_settings.read(out).params == {"width_price": 0.5}
    (adapter / model_settings.FILE).unlink()
    bundled._sync_settings(adapter, out)
    assert model_settings.read(out) is None


def test_the_shipped_smollm2_adapter_carries_the_setting_measured_best():
    s = model_settings.read(bundled.ASSETS / "smollm2-refusion")
    assert (s.decoder, s.params) == ("speculative", {"lookup": True, "fork": True, "width_price": 1.0})
    assert s.measured_by.startswith("refusion adapt smollm2 ")  # (its measurement stage chose it)


def test_info_names_the_decoder_the_settings_choose(model_dir, capsys):
    assert main(["info", str(model_dir)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["default_decoder"], d["decoding_settings"]) == ("speculative", None)
    model_settings.write(model_dir, ModelSettings("ar", {"gen_length": 16}, measured_by="python x.py"))
    assert main(["info", str(model_dir)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["default_decoder"] == "ar" and d["decoding_settings"]["params"] == {"gen_length": 16}
