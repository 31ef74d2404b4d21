"""Tokenizer: a Hugging Face `tokenizers` tokenizer plus what tokenizer_config.json adds
(special tokens, chat template rendered with Jinja2 the way transformers does).

Text is text: the content of chat messages (`chat_ids`, `chat_prompt_ids`) and training responses
is encoded with special-token strings read as ordinary text, so "<|im_end|>" or "<|mask|>" typed by
a user never becomes an end-of-turn, a role marker or the mask id; only the chat template puts
control tokens in a prompt. `encode(text)` reads them as control tokens (parse_special=True): the
raw prompt, which a caller opts into (`refusion generate --raw`, the completions endpoint).
"""

from __future__ import annotations

import functools
import json
import re
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
        self._text_tok: HFTokenizer | None = None  # a copy that reads special-token strings as text
        self._specials: re.Pattern | None = None

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
        # written by Python, so that a failed write is an OSError (the Rust library's is a bare Exception)
        (path / "tokenizer.json").write_text(self.tok.to_str(pretty=True), encoding="utf-8")
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

    def stop_ids(self, model_eos_ids: list[int]) -> list[int]:
        """The ids that end an answer: the model's EOS ids (its config) and this tokenizer's."""
        return sorted(set(model_eos_ids) | ({self.eos_id} if self.eos_id is not None else set()))

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
            self._text_tok = self._specials = None
        return [self.tok.token_to_id(t) for t in tokens]

    # ---- text -----------------------------------------------------------------------

    def _text_tokenizer(self) -> HFTokenizer:
        if self._text_tok is None:
            t = HFTokenizer.from_str(self.tok.to_str())
            t.encode_special_tokens = True  # the library's switch: special tokens are split like any text
            self._text_tok = t
        return self._text_tok

    def holds_special(self, text: str) -> bool:
        """Whether `text` holds the string of one of the special tokens (which encode() would read as
        that token)."""
        if self._specials is None:
            strings = sorted((t.content for t in self.tok.get_added_tokens_decoder().values() if t.special and t.content),
                             key=len, reverse=True)
            self._specials = re.compile("|".join(map(re.escape, strings))) if strings else re.compile(r"(?!)")
        return self._specials.search(text) is not None

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. parse_special=False: the strings of special tokens in it are ordinary
        text (split into ordinary tokens), as message content and training text are read."""
        return self.encode_many([text], add_special_tokens, parse_special)[0]

    def encode_many(self, texts: list[str], add_special_tokens: bool = False, parse_special: bool = True
                    ) -> list[list[int]]:
        tok = self.tok if parse_special else self._text_tokenizer()
        try:
            if len(texts) == 1:
                return [tok.encode(texts[0], add_special_tokens=add_special_tokens).ids]
            return [e.ids for e in tok.encode_batch(texts, add_special_tokens=add_special_tokens)]
        except TypeError:
            if all(isinstance(t, str) for t in texts):  # the library's own message: "TextInputSequence must be str"
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
        return self.chat_ids(msgs, **kwargs)

    def chat_ids(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """The chat template over `messages`, encoded with every message's content read as text: a
        special token's string in it stays text (module docstring)."""
        return self.chat_ids_many([messages], **kwargs)[0]

    def chat_ids_many(self, conversations: list[list[dict[str, Any]]], **kwargs: Any) -> list[list[int]]:
        """chat_ids of many conversations (encoded together, as a training set is)."""
        out: list[list[int] | None] = [None] * len(conversations)
        plain = [i for i, msgs in enumerate(conversations)
                 if not any(isinstance(m.get("content"), str) and self.holds_special(m["content"]) for m in msgs)]
        # content without a special token's string encodes the same either way: the whole text at once
        texts = [self.apply_chat_template(conversations[i], **kwargs) for i in plain]
        for i, ids in zip(plain, self.encode_many(texts), strict=True):
            out[i] = ids
        for i, msgs in enumerate(conversations):
            if out[i] is None:
                out[i] = self._chat_ids_split(msgs, **kwargs)
        return out

    def _chat_ids_split(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """chat_ids for messages whose content holds a special token's string. The template is
        rendered with a placeholder in place of each string content; the template's own text between
        placeholders is encoded with special tokens read (its markers become control tokens), and each
        content is encoded as plain text where its placeholder stood. Raises TokenizerError when the
        template does not show every placeholder exactly once (it drops, repeats or rewrites message
        text), since the content then has no single place to be kept as text."""
        marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
        shown = [dict(m, content=mark) if isinstance(m.get("content"), str) else m
                 for m, mark in zip(messages, marks, strict=True)]
        pieces = re.split("(\ue000\\d+\ue001)", self.apply_chat_template(shown, **kwargs))
        wanted = [mark for m, mark in zip(messages, marks, strict=True) if isinstance(m.get("content"), str)]
        if sorted(pieces[1::2]) != sorted(wanted):
            raise TokenizerError("a message holds the text of a special token (such as an end-of-turn marker), and "
                                 "this model's chat template changes message text, so it cannot be kept as text; "
                                 "remove it from the message")
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:
                ids += self.encode(messages[marks.index(piece)]["content"], parse_special=False)
            elif piece:
                ids += self.encode(piece)
        return ids


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
