"""`refusion self-generate`: each response is the model's own greedy output for the prompt as training
encodes it; an interrupted file is completed, not redone; test splits are refused."""

import json
import re

import pytest

from refusion.cli import main
from refusion.decoding import ARParams
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from refusion.tasks.maths import gsm8k_prompt
from refusion.training.data import DataError, encode_records, load_records
from refusion.training.self_generate import load_prompts
from tests.helpers.reference_ar import generate_ar
from tests.helpers.tiny_causal_lm import addition_records, make_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("sg")
    base = make_causal_lm(d / "base", std=0.3)
    (d / "add.jsonl").write_text("\n".join(json.dumps(r) for r in addition_records(20)))
    (d / "train.jsonl").write_text("\n".join(json.dumps({"question": f"Tom has {i} apples. How many?",
                                                         "answer": f"#### {i}"}) for i in range(10)))
    return d, base


def run(d, base, out, *extra) -> int:
    sources = f"jsonl:{d / 'add.jsonl'},gsm8k:{d / 'train.jsonl'}"
    return main(["self-generate", "--model", str(base), "--prompts", sources,
                 "--n", "3", "--max-tokens", "12", "--batch-size", "2", "--out", str(out), "--no-progress", *extra])


def test_responses_are_the_models_own_greedy_output_and_a_cut_file_is_completed(files, tmp_path, capsys):
    d, base = files
    out = tmp_path / "data.jsonl"
    assert run(d, base, out) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 6 and {r["source"] for r in recs} == {"jsonl", "gsm8k"}
    model, tok = load_model(base), Tokenizer.from_dir(base)
    for r in recs:
        want = generate_ar(model, [tok.chat_prompt_ids(r["query"])], ARParams(gen_length=12))[0]
        assert r["finished"] == want.finished
        assert r["response"] == tok.decode(want.tokens[:-1] if want.finished else want.tokens)
    assert sum(r["query"].endswith(gsm8k_prompt("")) for r in recs) == 3  # GSM8K questions as the benchmark asks
    # killed after four records, in the middle of the fifth: the file is completed, nothing is redone
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:4]) + "\n" + lines[4][:10])
    capsys.readouterr()
    assert run(d, base, out) == 0
    assert "2 responses written" in capsys.readouterr().err
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert again[:4] == recs[:4] and sorted(map(json.dumps, again)) == sorted(map(json.dumps, recs))
    # training reads them: EOS after finished responses only
    recs = load_records(out)
    exs = encode_records(recs, tok)
    assert [e.response[-1:] == [tok.eos_id] for e in exs] == [r["finished"] for r in recs]


def test_prompt_sources(files, tmp_path):
    d, _ = files
    (tmp_path / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 1"}))
    with pytest.raises(DataError, match="a test split"):
        load_prompts(f"gsm8k:{tmp_path / 'test.jsonl'}")
    with pytest.raises(DataError, match="unknown prompt source 'gsm8k'"):
        load_prompts("gsm8k")
    with pytest.raises(DataError, match="unknown prompt source 'mbpp'"):
        load_prompts("stdlib,mbpp")
    code = load_prompts("stdlib-functions", n=3)
    assert len(code) == 3 and all(re.fullmatch(r"Complete the following Python function\.\n```python\ndef .*"
                                               r"(\"\"\"|\'\'\')\n```", p.query, re.S) for p in code)
    assert load_prompts("stdlib-functions", n=3) == code  # seeded
    methods = load_prompts("stdlib-methods", n=3)
    # a method stands alone: its def at the left margin, its self kept, its docstring one level in
    assert len(methods) == 3 and all(re.fullmatch(r"Complete the following Python function\.\n```python\n"
                                                  r"def \w+\(self\b.*\n    [rbu]?(\"\"\"|\'\'\').*(\"\"\"|\'\'\')\n```",
                                                  p.query, re.S) for p in methods), [p.query for p in methods]
    assert {p.source for p in methods} == {"stdlib-methods"} and not {p.query for p in methods} & {p.query for p in code}
    assert [p.query for p in load_prompts(f"gsm8k:{d / 'train.jsonl'}")][:2] == [
        gsm8k_prompt("Tom has 0 apples. How many?"), gsm8k_prompt("Tom has 1 apples. How many?")]
    assert all(p.query.startswith("Continue this Python code:\n") for p in load_prompts("stdlib", n=2))
