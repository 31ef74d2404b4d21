"""The served model's tokenizer over HTTP, in vLLM's shapes: `POST /tokenize`, `POST /detokenize`,
`GET /tokenizer_info`.

lm-eval's API models look for these (its `tokenizer_backend=auto` checks /tokenizer_info and
/tokenize): with them, `--model local-completions` splits context from continuation with exactly
the server's tokenizer, and needs neither a tokenizer argument nor transformers.
"""

from __future__ import annotations

from typing import Any

from refusion.model.tokenizer import Tokenizer
from refusion.serve.schemas import RequestError, messages_of, object_of


def tokenize(tok: Tokenizer, body: Any, context: int) -> dict:
    """{"prompt": text, "add_special_tokens": bool} or {"messages": [...], "add_generation_prompt":
    bool} -> the ids."""
    d = object_of(body)
    bad = sorted(set(d) - {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"})
    if bad:
        raise RequestError(400, f"unrecognized request argument: {bad[0]!r}", bad[0])
    if ("prompt" in d) == ("messages" in d):
        raise RequestError(400, "give prompt (a string) or messages", "prompt")
    flags = {k: d.get(k, default) for k, default in (("add_special_tokens", False), ("add_generation_prompt", True))}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise RequestError(400, f"{k} must be a boolean", k)
    try:
        if "prompt" in d:
            if not isinstance(d["prompt"], str):
                raise RequestError(400, "prompt must be a string", "prompt")
            ids = tok.encode(d["prompt"], add_special_tokens=flags["add_special_tokens"])
        else:
            # as the chat endpoints read them: message content is text, so no control tokens in it
            ids = tok.chat_ids(messages_of(d["messages"]), add_generation_prompt=flags["add_generation_prompt"])
    except ValueError as e:
        if isinstance(e, RequestError):
            raise
        raise RequestError(400, f"cannot tokenize: {e}", "prompt" if "prompt" in d else "messages") from None
    return {"count": len(ids), "max_model_len": context, "tokens": ids}


def detokenize(tok: Tokenizer, body: Any, vocab_size: int) -> dict:
    """{"tokens": [ids]} -> {"prompt": their text}."""
    d = object_of(body)
    ids = d.get("tokens")
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise RequestError(400, "tokens must be a list of token ids", "tokens")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(400, f"token id {bad} is outside the vocabulary [0, {vocab_size})", "tokens")
    return {"prompt": tok.decode(ids, skip_special_tokens=False)}


def info(tok: Tokenizer, context: int) -> dict:
    """The special tokens' texts, the chat template and the context."""
    def text(i: int | None) -> str | None:
        return None if i is None else tok.decode([i], skip_special_tokens=False)

    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": text(tok.eos_id), "bos_token": text(tok.bos_id),
            "pad_token": text(tok.pad_id), "chat_template": tok.config.get("chat_template"),
            "model_max_length": context, "vocab_size": len(tok)}
