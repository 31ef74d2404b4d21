"""The server's pieces without a server: request parsing, decoder choice, text assembly."""

import json

import pytest

pytest.importorskip("starlette")

from refusion.bundled import BUNDLED  # noqa: E402
from refusion.serve.params import choose  # noqa: E402
from refusion.decoding.model_settings import ModelSettings  # noqa: E402
from refusion.serve.schemas import Constraint, RequestError, loads, parse_chat, parse_completion  # noqa: E402
from refusion.serve.text import TextAssembler  # noqa: E402
from refusion.model.tokenizer import Tokenizer  # noqa: E402
from tests.helpers.serving import CFG, NO_MASK  # noqa: E402


def status(fn, *a):
    with pytest.raises(RequestError) as e:
        fn(*a)
    return e.value.status, e.value.message


@pytest.mark.parametrize("body,fragment", [
    (b"{", "not valid JSON"),
    (b"\xff\xfe{}", "not valid UTF-8"),
    (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    (b'{"prompt": NaN}', "not valid JSON"),
])
def test_loads_refuses_what_is_not_json(body, fragment):
    code, msg = status(loads, body)
    assert code == 400 and fragment in msg


@pytest.mark.parametrize("body,fragment", [
    ([], "must be a JSON object"),
    ({}, "missing required field: prompt"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": ["a", ""]}, "prompt is empty"),
    ({"prompt": [[1, 2], []]}, "prompt is empty"),
    ({"prompt": [1, "a"]}, "a list of token ids, or a list of either"),
    ({"prompt": [["a"]]}, "a list of token ids, or a list of either"),
    ({"prompt": ["a"] * 65, "n": 2}, "at most 128 choices per request: 65 prompts x n 2"),
    ({"prompt": 5}, "prompt must be a string"),
    ({"prompt": "hi", "max_tokens": "10"}, "max_tokens must be an integer"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens must be an integer"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature must be a number"),
    ({"prompt": "hi", "temperature": 10**400}, "temperature must lie in"),
    ({"prompt": "hi", "top_p": 0}, "top_p must be greater than 0"),
    ({"prompt": "hi", "n": 0}, "n must be in [1, 128]"),
    ({"prompt": "hi", "n": 129}, "n must be in [1, 128]"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ({"prompt": "hi", "stop": [""]}, "must not be empty"),
    ({"prompt": "hi", "stop": 3}, "stop must be a string"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs must be in [0, 20]"),
    ({"prompt": "hi", "logprobs": True}, "logprobs must be an integer"),
    ({"prompt": "hi", "top_logprobs": 2}, "unrecognized request argument: 'top_logprobs'"),
    ({"prompt": "hi", "echo": 1}, "echo must be a boolean"),
    ({"prompt": "hi", "max_tokens": 0, "echo": False}, "max_tokens must be >= 1"),
    ({"prompt": "hi", "logit_bias": [1]}, "logit_bias must be an object"),
    ({"prompt": "hi", "logit_bias": {"a": 1}}, "keys must be token ids"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "must be a number in [-100, 100]"),
    ({"prompt": "hi", "logit_bias": {"5": "1"}}, "must be a number in [-100, 100]"),
    ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty must lie in [-2, 2]"),
    ({"prompt": "hi", "frequency_penalty": "1"}, "frequency_penalty must be a number"),
    ({"prompt": "hi", "response_format": "json"}, "response_format must be an object with a type"),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, "must be text, json_object or json_schema"),
    ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "json_schema must be an object"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema is missing"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
     "json_schema.schema must be an object"),
    ({"prompt": "hi", "response_format": {"type": "json_object", "json_schema": {}}}, "takes no field"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"prompt": "hi", "structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar is not supported"),
    ({"prompt": "hi", "structured_outputs": {"choice": []}}, "non-empty list"),
    ({"prompt": "hi", "structured_outputs": {"json": "{"}}, "structured_outputs.json is not valid JSON"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "not both"),
    ({"prompt": "hi", "guided_regex": "a+"}, "guided_regex is now structured_outputs.regex"),
    ({"prompt": "hi", "tools": [{"type": "function"}]}, "tools is not supported"),
    ({"prompt": "hi", "slot_sise": 8}, "unrecognized request argument: 'slot_sise'"),
    ({"prompt": "\ud800"}, "lone surrogate"),
    ({"prompt": "hi", "seed": 2**70}, "seed must be in"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "needs stream: true"),
])
def test_completion_bodies_refused_with_a_reason(body, fragment):
    code, msg = status(parse_completion, body)
    assert code == 400 and fragment in msg, msg


@pytest.mark.parametrize("body,fragment", [
    ({}, "missing required field: messages"),
    ({"messages": []}, "non-empty list"),
    ({"messages": ["hi"]}, "messages[0] must be an object"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role must be"),
    ({"messages": [{"role": "user", "content": 3}]}, "content must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "must be a text part"),
    ({"messages": [{"role": "user", "content": ""}]}, "no content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "max_completion_tokens": 3}, "not both"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs needs logprobs: true"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "in [0, 20]"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs must be a boolean"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "unrecognized request argument: 'echo'"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens must be >= 1"),
])
def test_chat_bodies_refused_with_a_reason(body, fragment):
    code, msg = status(parse_chat, body)
    assert code == 400 and fragment in msg, msg


def test_accepted_bodies():
    r = parse_completion({"prompt": [[1, 2, 3]], "max_tokens": 8, "temperature": 0, "stop": "\n", "seed": 3,
                          "user": "me", "logprobs": None, "decoder": "refusion", "slot_size": 4})
    assert (r.prompt, r.max_tokens, r.temperature, r.stop, r.seed) == ([1, 2, 3], 8, 0.0, ["\n"], 3)
    assert (r.decoder, r.decoder_params) == ("refusion", {"slot_size": 4})
    several = parse_completion({"prompt": ["a", [5, 6]], "n": 64})
    assert several.prompts == ["a", [5, 6]] and several.prompt == "a"
    c = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]},
                                 {"role": "user", "content": "b"}], "max_completion_tokens": 5})
    assert c.messages == [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}] and c.max_tokens == 5


def test_accepted_controls():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = parse_completion({"prompt": "x", "n": 3, "logprobs": 2, "echo": True, "max_tokens": 0,
                          "logit_bias": {"17": -100, "5": 2.5}, "presence_penalty": 0.5, "frequency_penalty": -1,
                          "structured_outputs": {"json": json.dumps(schema)}})
    assert (r.n, r.logprobs, r.echo, r.max_tokens) == (3, 2, True, 0)
    assert r.logit_bias == {17: -100.0, 5: 2.5} and (r.presence_penalty, r.frequency_penalty) == (0.5, -1.0)
    assert r.constraint == Constraint("json_schema", schema, "structured_outputs.json")
    assert r.control_fields() == ["structured_outputs", "logprobs", "logit_bias", "presence_penalty",
                                  "frequency_penalty"]
    c = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema,
                                                                               "strict": True}}})
    assert c.logprobs == 0 and c.constraint == Constraint("json_schema", schema, "response_format")
    five = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 5})
    assert five.logprobs == 5
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": False}).logprobs is None
    # OpenAI's defaults ask for nothing
    d = parse_completion({"prompt": "x", "response_format": {"type": "text"}, "logit_bias": {}, "presence_penalty": 0,
                          "n": 1, "echo": False, "tool_choice": "none"})
    assert d.control_fields() == [] and d.constraint is None
    assert parse_completion({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}).constraint == Constraint(
        "choice", ["a", "b"], "structured_outputs.choice")


@pytest.mark.parametrize("fields,decoder", [
    ({"logprobs": 1}, "speculative"),
    ({"logit_bias": {"3": 1}}, "speculative"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "speculative"),
    ({"logprobs": 1, "decoder": "ar"}, "ar"),
    ({}, "refusion"),
])
def test_controls_run_speculative_where_the_default_cannot(tmp_path, fields, decoder):
    # a model whose decoding.json chooses plan-and-infill, which applies no controls
    settings = ModelSettings("refusion", {"slot_size": 4})
    c = choose(parse_completion({"prompt": "x", **fields}), CFG, 16, settings)
    assert c.decoder == decoder


@pytest.mark.parametrize("fields,param", [
    ({"decoder": "refusion", "logprobs": 1}, "logprobs"),
    ({"decoder": "mdm", "response_format": {"type": "json_object"}}, "response_format"),
    ({"decoder": "mdm-threshold", "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    ({"decoder": "refusion-l2r", "presence_penalty": 1}, "presence_penalty"),
])
def test_a_named_decoder_that_cannot_apply_controls_is_refused(fields, param):
    with pytest.raises(RequestError) as e:
        choose(parse_completion({"prompt": "x", **fields}), CFG, 32)
    assert e.value.param == param and "the decoders that can: speculative, ar" in e.value.message, e.value.message


@pytest.mark.parametrize("fields,fragment", [
    ({"decoder": "beam"}, "unknown decoder 'beam'"),
    ({"decoder": "mdm", "slot_size": 8}, "decoder 'mdm' does not take slot_size"),
    ({"decoder": "refusion", "slot_size": 0}, "slot_size must be an integer >= 1"),
    ({"decoder": "mdm", "steps": 100}, "steps 100 exceeds max_tokens 64"),
    ({"decoder": "refusion", "slot_size": 8.5}, "slot_size must be an integer"),
    ({"decoder": "refusion", "checks": 1}, "checks must be a boolean"),
    ({"decoder": "refusion", "top_p": 0.5}, "does not sample with top_p"),
    ({"decoder": "mdm", "threshold": 0.5}, "use 'mdm-threshold'"),
    ({"decoder": "mdm", "steps": 5}, "steps 5 must be a positive multiple"),
    ({"decoder": "ar", "top_k": 0}, "top_k must be an integer >= 1"),
])
def test_decoder_parameters_validated_like_the_cli(fields, fragment):
    body = {"prompt": "hi", "max_tokens": 64, **fields}
    code, msg = status(choose, parse_completion(body), CFG, 64)
    assert code == 400 and fragment in msg, msg


@pytest.mark.parametrize("fields,max_tokens,gen_length", [
    ({"decoder": "refusion", "slot_size": 7}, 64, 70),
    ({"decoder": "refusion", "slot_size": 16}, 40, 48),
    ({"decoder": "refusion-l2r"}, 64, 64),
    ({"decoder": "mdm", "block_length": 32}, 50, 64),
    ({"decoder": "mdm-threshold", "block_length": 16}, 1, 16),
    ({"decoder": "speculative"}, 50, 50),
    ({"decoder": "ar"}, 7, 7),
])
def test_max_tokens_rounded_up_to_whole_blocks(fields, max_tokens, gen_length):
    c = choose(parse_completion({"prompt": "x", **fields}), CFG, max_tokens)
    assert (c.gen_length, c.cut) == (gen_length, max_tokens)


def test_decoder_refusals_speak_of_max_tokens():
    # mdm decodes max_tokens 50 as two blocks of 32: the message says so, and names the field
    with pytest.raises(RequestError) as e:
        choose(parse_completion({"prompt": "x", "decoder": "mdm", "steps": 100}), CFG, 50)
    assert e.value.message == ("steps 100 exceeds max_tokens 50, rounded up to whole blocks, 64: every step must "
                               "commit a token")
    assert e.value.param == "steps"


def test_decoder_choice():
    c = choose(parse_completion({"prompt": "x", "decoder": "mdm-threshold"}), CFG, 64)
    assert c.params == {"gen_length": 64} and c.spec is None  # decode() fills in the threshold
    c = choose(parse_completion({"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 5}), NO_MASK, 32)
    assert c.decoder == "ar" and c.params == {"gen_length": 32, "temperature": 0.5, "top_p": 0.9, "top_k": 5}
    assert choose(parse_completion({"prompt": "x"}), CFG, 16).decoder == "speculative"
    # top_p 1 is OpenAI's default and a no-op: accepted at temperature 0, where top_p < 1 is refused
    assert "top_p" not in choose(parse_completion({"prompt": "x", "top_p": 1}), CFG, 16).params
    code, msg = status(choose, parse_completion({"prompt": "x", "top_p": 0.5}), CFG, 16)
    assert "set temperature > 0" in msg
    code, msg = status(choose, parse_completion({"prompt": "x", "decoder": "refusion"}), NO_MASK, 16)
    assert "needs a model with a mask token" in msg


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(BUNDLED)


def test_text_is_released_in_position_order(tok):
    ids = tok.encode("def f(x):\n    return x + 1")
    eos = tok.eos_id
    a = TextAssembler(tok, 10, [eos], [])
    # commit the second half first: nothing can be shown until the prefix is complete
    half = len(ids) // 2
    assert a.add(list(range(10 + half, 10 + len(ids))), ids[half:]) == ""
    first = a.add(list(range(10, 10 + half)), ids[:half])
    assert first == tok.decode(ids)
    assert a.add([10 + len(ids)], [eos]) == "" and a.ended and a.finish() == ""


def test_stop_strings_cut_and_hold_back(tok):
    ids = tok.encode("Answer: 42\nmore text")
    a = TextAssembler(tok, 0, [tok.eos_id], ["\nmore"])
    out = ""
    for i, t in enumerate(ids):  # one token at a time: a partial "\nmo" must be held back
        out += a.add([i], [t])
        assert "\n" not in out
    assert a.stopped and out == "Answer: 42"
    assert tok.decode(ids[:a.tokens_at_stop]).startswith("Answer: 42\nmore")


def test_each_choice_gets_its_seed():
    from refusion.serve.app import _seeds
    from refusion.serve.schemas import MAX_SEED

    assert _seeds(7, 3, sampled=True) == [7, 8, 9]
    assert _seeds(MAX_SEED - 1, 3, sampled=False) == [MAX_SEED - 1, MAX_SEED, 0]  # wraps within the range
    assert _seeds(-2, 3, sampled=True) == [MAX_SEED - 1, MAX_SEED, 0]  # OpenAI's negative seeds too
    assert _seeds(None, 2, sampled=False) == [None, None]  # greedy: no seed needed
    fresh = _seeds(None, 4, sampled=True)
    assert len(set(fresh)) == 4 and all(0 <= s <= MAX_SEED for s in fresh)


def test_n_rows_count_against_the_request_limit():
    from refusion.serve import budget

    c = choose(parse_completion({"prompt": "x", "decoder": "refusion", "slot_size": 8}), CFG, 64)
    budget.check(100, c, 512, 400, n=2)  # 2 x (100 + 64) = 328 fits
    with pytest.raises(RequestError) as e:
        budget.check(100, c, 512, 400, n=3)
    assert e.value.param == "n" and e.value.message.startswith("this request needs 3 x 164 tokens")
