import json
import os
import shutil

import pytest
import torch
import transformers

from refusion.decoding import costs
from refusion.model.fetch import qwen3_tokenizer_files

# pytest-xdist (addopts: -n 2) runs the tests in worker processes: each gets its share of the cores
# (and its subprocesses, through OMP_NUM_THREADS), as torch would otherwise give every worker a thread
# per core, and threads that outnumber the cores spin-wait on each other (small tests ran 30x slower)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _SHARE = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_SHARE)
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)


@pytest.fixture(scope="session", autouse=True)
def cost_tables_of_its_own(tmp_path_factory):
    """The suite's processes (its command-line and script subprocesses) measure forward costs on a busy
    machine; decoding/costs.py keeps measured tables in the cache, where they would become the user's.
    The suite gets a cache of its own whose downloads (models, packages) are the user's."""
    from refusion.model.fetch import cache_dir

    real, mine = cache_dir(), tmp_path_factory.mktemp("refusion-cache")
    for name in ("models", "pypi", "npm"):
        (real / name).mkdir(parents=True, exist_ok=True)
        (mine / name).symlink_to(real / name, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REFUSION_CACHE", str(mine))
        yield


def pytest_collection_modifyitems(items):
    """The tests that take minutes (marked slow or long) first: parallel workers then end together,
    rather than one running a long test collected last while the other waits."""
    items.sort(key=lambda item: not (item.get_closest_marker("slow") or item.get_closest_marker("long")))

QWEN3_VOCAB = 151936  # the published checkpoint's padded embedding size
BEGIN_ID, MASK_ID, IM_END, ENDOFTEXT = 151669, 151670, 151645, 151643


def write_qwen3_tokenizer(path, extra_tokens=("<|beginoftext|>", "<|mask|>")):
    """The real Qwen3 tokenizer, with the tokens ReFusion adds, saved by transformers itself."""
    tj, tc = qwen3_tokenizer_files()
    src = path / "_src"
    src.mkdir(parents=True)
    shutil.copy(tj, src / "tokenizer.json")
    shutil.copy(tc, src / "tokenizer_config.json")
    tok = transformers.AutoTokenizer.from_pretrained(src)
    if extra_tokens:
        tok.add_special_tokens({"additional_special_tokens": list(extra_tokens)},
                               replace_extra_special_tokens=False)
        tok.mask_token = "<|mask|>" if "<|mask|>" in extra_tokens else None
    tok.save_pretrained(path)
    shutil.rmtree(src)
    return tok


@pytest.fixture(scope="session")
def refusion_layout_dir(tmp_path_factory):
    """A tiny random model in exactly the layout of GSAI-ML/ReFusion: Qwen3ForCausalLM, vocab 151936,
    mask_token_id 151670, <|beginoftext|> 151669 and <|mask|> 151670 added to the Qwen3 tokenizer,
    sharded safetensors with an index, generation_config.json; written by transformers, not by us."""
    path = tmp_path_factory.mktemp("refusion_layout")
    tok = write_qwen3_tokenizer(path)
    assert tok.convert_tokens_to_ids(["<|beginoftext|>", "<|mask|>"]) == [BEGIN_ID, MASK_ID]
    cfg = transformers.Qwen3Config(
        vocab_size=QWEN3_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=ENDOFTEXT, eos_token_id=IM_END, pad_token_id=ENDOFTEXT)
    cfg.mask_token_id = MASK_ID
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path, max_shard_size="8MB")
    config = json.loads((path / "config.json").read_text())
    assert config["mask_token_id"] == MASK_ID and (path / "model.safetensors.index.json").exists()
    return path


@pytest.fixture(autouse=True)
def fixed_forward_cost(monkeypatch):
    """The speculative decoder's default width policy sizes its drafts by measured forward timings
    (decoding/widths.py); every test runs it on one fixed cost table instead, so that no test's
    widths depend on how busy the machine is (tests/decoding/test_widths.py measures). A CPU's shape: a
    cost per forward, per row and per token computed, in about the bundled model's proportions."""
    cost = costs.CostModel.of(lambda rows, tokens: 1e-3 * (1 + 0.1 * rows + 0.03 * tokens))
    monkeypatch.setattr(costs, "cost_model", lambda model: cost)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: one thread is much faster, and immune to a busy second core."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def fed_kinds(monkeypatch):
    """The kind of draft (decoding/widths.py) each speculative step feeds, per row, in order."""
    from refusion.decoding import speculative

    kinds = []
    plain = speculative.SpeculativeSeq.next_feed

    def next_feed(self):
        kinds.append(self.kind)
        return plain(self)

    monkeypatch.setattr(speculative.SpeculativeSeq, "next_feed", next_feed)
    return kinds
