"""Models by name or by adapter directory (refusion.bundled.resolve_model): a mask adapter is attached
to the base it names, once, and every command loads the result like any model directory."""

import json

import pytest
import torch

from refusion import bundled
from refusion.bundled import resolve_model
from refusion.cli import main
from refusion.decoding import ARParams
from refusion.model.checkpoint import add_mask_token, load_model
from refusion.model.mask_adapter import ADAPTER_CONFIG, add_mask_adapter, adapter_parameters, save_mask_adapter
from refusion.model.tokenizer import Tokenizer
from tests.helpers.reference_ar import generate_ar
from tests.helpers.tiny_causal_lm import make_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_causal_lm(tmp_path_factory.mktemp("base") / "base", std=0.3)


def write_adapter(base_dir, path, base_name: str, seed: int = 0):
    model, tok = load_model(base_dir), Tokenizer.from_dir(base_dir)
    add_mask_token(model, tok)
    add_mask_adapter(model, {"rank": 2})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save_mask_adapter(model, path, base=base_name)
    return model


def test_an_adapter_directory_is_its_base_with_it_attached(base_dir, cache, tmp_path):
    want = write_adapter(base_dir, tmp_path / "run" / "adapter", str(base_dir))
    path = resolve_model(tmp_path / "run" / "adapter")
    assert path.name == "run-adapter" and cache in path.parents
    model = load_model(path)
    ids = torch.tensor([[5, 9, 12, model.config.mask_token_id, model.config.mask_token_id]])
    pos = torch.arange(5)[None]
    with torch.no_grad():
        assert torch.equal(model(ids, pos), want(ids, pos))
    assert Tokenizer.from_dir(path).mask_id == model.config.mask_token_id
    # built once; a changed adapter gets a directory of its own
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(tmp_path / "run" / "adapter") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    write_adapter(base_dir, tmp_path / "run" / "adapter", str(base_dir), seed=1)
    assert resolve_model(tmp_path / "run" / "adapter") != path


def test_a_shipped_adapter_by_name_decodes_the_bases_greedy_output(base_dir, cache, tmp_path, monkeypatch, capsys):
    assets = tmp_path / "assets"
    write_adapter(base_dir, assets / "tiny-refusion", "smollm2")  # named base, as the shipped asset names it
    monkeypatch.setattr(bundled, "ASSETS", assets)
    monkeypatch.setattr(bundled, "smollm2_dir", lambda: base_dir)
    assert "tiny-refusion" in bundled.model_names() and bundled.is_model_name("tiny-refusion")
    prompt = Tokenizer.from_dir(base_dir).chat_prompt_ids("What is 3 plus 4?")
    assert main(["generate", "--model", "tiny-refusion", "--prompt-ids", ",".join(map(str, prompt)),
                 "--gen-length", "24", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = generate_ar(load_model(base_dir), [prompt], ARParams(gen_length=24))[0].tokens
    assert got["decoder"] == "speculative" and got["tokens"] == want
    # the masks were fed beside the clean tokens (drafts of a random adapter, all rejected): more than
    # AR's prompt and one token per forward
    assert got["tokens_fed"] > len(prompt) + got["forwards"]
    assert load_model(got["model"]).config.mask_adapter == {"rank": 2, "alpha": 4.0}


def test_names_and_adapters_that_do_not_fit_are_refused(base_dir, cache, tmp_path, capsys):
    assert resolve_model("refusion-tiny") == resolve_model(None) == bundled.BUNDLED
    assert resolve_model(str(base_dir)) == base_dir  # a directory is itself
    with pytest.raises(ValueError, match="neither a model directory nor a model name"):
        resolve_model("no-such-model")
    write_adapter(base_dir, tmp_path / "lost", str(tmp_path / "gone"))
    with pytest.raises(ValueError, match="its base model .* cannot be found"):
        resolve_model(tmp_path / "lost")
    other = make_causal_lm(tmp_path / "other", std=0.3)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] += 2  # another base: a vocabulary of another size
    write_adapter(base_dir, tmp_path / "mismatch", str(other))
    (other / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file, save_file

    sd = load_file(other / "model.safetensors")
    sd["model.embed_tokens.weight"] = torch.cat([sd["model.embed_tokens.weight"], sd["model.embed_tokens.weight"][:2]])
    save_file(sd, other / "model.safetensors")
    assert main(["generate", "--model", str(tmp_path / "mismatch"), "--prompt-ids", "1,2"]) == 2
    assert "does not fit its base" in capsys.readouterr().err
    assert json.loads((tmp_path / "mismatch" / ADAPTER_CONFIG).read_text())["base"] == str(other)
