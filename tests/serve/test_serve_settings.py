"""The server's decoder choice starts from the model's decoding.json, and a request field that is no
longer public is refused with what replaces it."""

import pytest

pytest.importorskip("starlette")

from refusion.decoding.model_settings import ModelSettings  # noqa: E402
from refusion.serve.params import choose  # noqa: E402
from refusion.serve.schemas import RequestError, decoder_fields, parse_chat, parse_completion  # noqa: E402
from tests.helpers.serving import CFG  # noqa: E402

SETTINGS = ModelSettings("speculative", {"fork": True, "width_price": 0.25, "draft_length": 8})


@pytest.mark.parametrize("field, says", [
    ("fork", "fork is not a request field: it is a Python-only setting of the decoder"),
    ("width_price", "width_price is not a request field"),
    ("widths", "widths is not a request field"),
    ("adaptive", "adaptive is not a request field"),
    ("serial_blocks", "serial_blocks is not a request field"),
    ("join_check", "join_check is now part of checks"),
    ("recheck_rows", "recheck_rows is now part of checks"),
])
def test_a_field_that_is_no_longer_public_is_refused_with_what_replaces_it(field, says):
    for parse, body in ((parse_completion, {"prompt": "x"}), (parse_chat, {"messages": [{"role": "user",
                                                                                         "content": "x"}]})):
        with pytest.raises(RequestError) as e:
            parse({**body, field: True})
        assert (e.value.status, e.value.param) == (400, field) and says in e.value.message


def test_the_extra_fields_are_the_documented_few():
    assert set(decoder_fields()) == {"decoder", "top_k", "draft_length", "accept_prob", "slot_size",
                                     "slot_threshold", "token_threshold", "checks", "block_length", "steps",
                                     "threshold"}


def test_a_request_starts_from_the_models_settings_and_its_fields_win():
    c = choose(parse_completion({"prompt": "x"}), CFG, 32, SETTINGS)
    assert c.decoder == "speculative" and (c.spec.fork, c.spec.width_price, c.spec.draft_length) == (True, 0.25, 8)
    c = choose(parse_completion({"prompt": "x", "draft_length": 4}), CFG, 32, SETTINGS)
    assert (c.spec.fork, c.spec.draft_length) == (True, 4)
    c = choose(parse_completion({"prompt": "x", "decoder": "ar"}), CFG, 32, SETTINGS)
    assert c.params == {"gen_length": 32}  # another decoder: none of the file's settings
    c = choose(parse_completion({"prompt": "x"}), CFG, 32, ModelSettings("refusion", {"checks": True}))
    assert c.decoder == "refusion" and c.params == {"gen_length": 32, "checks": True}
