"""Tokenizer: a Hugging Face `tokenizers` tokenizer plus what tokenizer_config.json adds
(special tokens, chat template rendered with Jinja2 the way transformers does)."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

MASK_TOKEN = "<|mask|>"


class TokenizerError(ValueError):
    pass


def _token_str(t: Any) -> str | None:
    return t.get("content") if isinstance(t, dict) else t


class Tokenizer:
    def __init__(self, tok: HFTokenizer, config: dict[str, Any] | None = None) -> None:
        self.tok = tok
        self.config = dict(config or {})

    # ---- loading / saving ---------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        f = path / "tokenizer.json"
        if not f.exists():
            raise TokenizerError(f"{path} has no tokenizer.json (a Hugging Face fast tokenizer file is required)")
        cfg_file = path / "tokenizer_config.json"
        cfg = {}
        if cfg_file.exists():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise TokenizerError(f"{cfg_file} is not valid JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{cfg_file} holds a JSON {type(cfg).__name__}, not an object")
        if "chat_template" not in cfg and (path / "chat_template.jinja").exists():
            cfg["chat_template"] = (path / "chat_template.jinja").read_text()
        try:
            tok = HFTokenizer.from_file(str(f))
        except Exception as e:  # the Rust library raises a bare Exception for any unreadable file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TokenizerError(f"{f} is not a readable Hugging Face tokenizer file ({first})") from None
        return cls(tok, cfg)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        self.tok.save(str(path / "tokenizer.json"))
        cfg = dict(self.config)
        decoder = dict(cfg.get("added_tokens_decoder") or {})
        for tid, t in self.tok.get_added_tokens_decoder().items():
            decoder[str(tid)] = {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                                 "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        cfg["added_tokens_decoder"] = dict(sorted(decoder.items(), key=lambda kv: int(kv[0])))
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
        special = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token", "mask_token") if cfg.get(k)}
        (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False))

    # ---- ids ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def _special_id(self, key: str) -> int | None:
        s = _token_str(self.config.get(key))
        return None if s is None else self.tok.token_to_id(s)

    @property
    def eos_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def mask_id(self) -> int | None:
        return self.tok.token_to_id(_token_str(self.config.get("mask_token")) or MASK_TOKEN)

    def special_roles(self) -> dict[int, str]:
        """The tokenizer's special tokens by id, each with its role: "eos", "bos", "pad" or "unk"
        where the config names it so (eos wins where one token has several), else "special" (any
        other token added as special: chat markers, an unused <|mask|>)."""
        roles = {tid: "special" for tid, t in self.tok.get_added_tokens_decoder().items() if t.special}
        for key in ("unk_token", "pad_token", "bos_token", "eos_token"):
            tid = self._special_id(key)
            if tid is not None:
                roles[tid] = key.removesuffix("_token")
        return roles

    def add_special_tokens(self, tokens: list[str]) -> list[int]:
        """Add tokens (if absent) as special tokens; return their ids."""
        missing = [t for t in tokens if self.tok.token_to_id(t) is None]
        if missing:
            self.tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        return [self.tok.token_to_id(t) for t in tokens]

    # ---- text -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            return self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            if isinstance(text, str):  # the library's own message: "TextInputSequence must be str"
                raise TokenizerError("the text is not valid Unicode (it holds lone surrogates, as undecodable bytes "
                                     "become in Python); pass UTF-8 text") from None
            raise

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not template:
            raise TokenizerError("this tokenizer has no chat_template; pass raw token ids or a model with one")
        return _render(template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=_token_str(self.config.get("bos_token")) or "",
                       eos_token=_token_str(self.config.get("eos_token")) or "", **kwargs)

    def chat_prompt_ids(self, user_text: str, system: str | None = None, **kwargs: Any) -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
        return self.encode(self.apply_chat_template(msgs, **kwargs))


def _raise(msg: str) -> None:
    raise TokenizerError(f"chat template: {msg}")


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    # The same sandbox, trimming and helpers transformers gives chat templates. Compiled once:
    # encoding a training set renders the template for every record.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _render(template: str, **ctx: Any) -> str:
    from jinja2 import TemplateError

    try:
        return _compile(template).render(**ctx)
    except TemplateError as e:  # a broken template in someone's tokenizer_config.json
        raise TokenizerError(f"chat template: {e}") from None
