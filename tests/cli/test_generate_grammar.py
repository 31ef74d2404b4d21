"""`refusion generate --json-schema FILE` / `--regex PATTERN`: the Python API's constrained output,
valid; a decoder or spec that cannot serve is one line and exit code 2."""

import json
import re

import pytest

from refusion.bundled import BUNDLED
from refusion.cli import main
from refusion.decoding import Controls, decode, grammar
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"sorted": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 99}, "maxItems": 5}},
          "required": ["sorted"], "additionalProperties": False}
PROMPT = "Sort: 99 18 76 22 64"


@pytest.fixture(scope="module")
def schema_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("grammar") / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return path


@pytest.mark.parametrize("decoder", ["speculative", "ar"])
def test_json_schema_output_is_the_python_apis_and_valid(schema_file, capsys, decoder):
    jsonschema = pytest.importorskip("jsonschema")
    rc = main(["generate", PROMPT, "--model", str(BUNDLED), "--decoder", decoder, "--gen-length", "48",
               "--json-schema", str(schema_file), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    tok = Tokenizer.from_dir(BUNDLED)
    (ref,) = decode(load_model(BUNDLED), [tok.chat_prompt_ids(PROMPT)], decoder, gen_length=48,
                    controls=Controls(grammar=grammar.json_schema(tok, SCHEMA)))
    assert out["tokens"] == ref.tokens and out["finished"]
    jsonschema.validate(json.loads(out["text"]), SCHEMA)


def test_regex_output_matches(capsys):
    pattern = "[0-9]+( [0-9]+){4}"
    assert main(["generate", PROMPT, "--model", str(BUNDLED), "--regex", pattern, "--no-view"]) == 0
    assert re.fullmatch(pattern, capsys.readouterr().out.strip())


@pytest.mark.parametrize("flags, message", [
    (["--regex", "a(b"], "invalid regex: .*unclosed group"),
    (["--json-schema", "{bad}"], "--json-schema .*bad.json: invalid json schema: Invalid type: nonsense"),
    (["--json-schema", "{missing}"], "No such file"),
    (["--json-schema", "{good}", "--regex", "a+"], "give --json-schema or --regex, not both"),
    (["--regex", "a+", "--decoder", "refusion"], "need a decoder that keeps to a grammar exactly \\(speculative, ar\\)"),
])
def test_bad_grammar_flags_are_one_line_and_exit_code_2(tmp_path, schema_file, capsys, flags, message):
    (tmp_path / "bad.json").write_text('{"type": "nonsense"}')
    paths = dict(bad=tmp_path / "bad.json", missing=tmp_path / "missing.json", good=schema_file)
    argv = ["generate", PROMPT, "--model", str(BUNDLED), "--gen-length", "16"] + [f.format(**paths) for f in flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
