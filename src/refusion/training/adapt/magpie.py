"""A model's own user turns, as Magpie makes them (Xu et al. 2024, arXiv 2406.08464): the chat template
up to where a user's message begins, and nothing after, so that an instruct model writes the question
it expects to be asked. Sampled (each row with a seed of its own, so a resumed run draws the same
questions), then kept only when the model ended the turn, it reads as a request, and it is new.

The raw samples are appended to a JSONL file as they finish ({"seed", "text", "finished"}); seeds
already there are not drawn again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refusion.decoding import ARParams
    from refusion.model.tokenizer import Tokenizer
    from refusion.model.transformer import Transformer

_SENTINEL = "\u2063REFUSION-USER-TURN\u2063"
MIN_CHARS, MAX_CHARS = 16, 600


def user_prefix_ids(tok: Tokenizer) -> list[int]:
    """The token ids of the chat template up to the start of a user's message (its system turn, if the
    template adds one by default, included). A ValueError when the template has no place for one."""
    text = tok.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    if text.count(_SENTINEL) != 1:
        raise ValueError("the chat template does not show the user's message once: it cannot prompt the model "
                         "for a user turn (give --mix without prose, or --prompts-file)")
    return tok.encode(text.split(_SENTINEL)[0])


def normalized(text: str) -> str:
    """Lower-case words only: two questions that differ in case, spacing or punctuation are one."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def acceptable(text: str, specials: list[str]) -> bool:
    """Whether a sampled user turn reads as a request: not too short or long, a few words, no chat
    markup leaking in."""
    t = text.strip()
    return (MIN_CHARS <= len(t) <= MAX_CHARS and len(t.split()) >= 4 and not any(s in t for s in specials)
            and any(c.isalpha() for c in t[:3]))


def sample_user_turns(model: Transformer, tok: Tokenizer, out: Path, seeds: range, max_tokens: int = 96,
                      temperature: float = 1.0, top_p: float = 0.95, batch_size: int = 32,
                      progress: bool = True, lead: str = "", desc: str = "user turns") -> None:
    """Draw one user turn per seed not yet in `out` (appended to it as each finishes), batch_size at a
    time in one continuous batch. `lead`: the turn's first words, given (a record's text starts with
    them), so that the model writes a request of that kind."""
    from refusion.decoding import ARParams

    prefix = user_prefix_ids(tok) + (tok.encode(lead) if lead else [])
    sample_into(model, tok, out, seeds, lambda seed: prefix, ARParams(gen_length=max_tokens, temperature=temperature,
                top_p=top_p), batch_size, progress, desc, "turn", lead)


def sample_into(model: Transformer, tok: Tokenizer, out: Path, seeds: Iterable[int], prompt_of: Callable[[int], list[int]],
                params: ARParams, batch_size: int, progress: bool, desc: str, unit: str, lead: str = "") -> None:
    """Sample a continuation of each seed's prompt (`prompt_of(seed)`, token ids) from that seed, for the
    seeds not yet in `out`, in one continuous batch; each appended as it finishes, {"seed", "text" (lead
    and the continuation, without its EOS), "finished"}."""
    from refusion.training.self_generate import decode_stream

    done = _done_seeds(out)
    todo = [s for s in seeds if s not in done]
    if not todo:
        return
    from tqdm import tqdm

    eos = tok.stop_ids(model.config.eos_ids)
    with (open(out, "a", encoding="utf-8") as f,
          tqdm(total=len(todo), desc=desc, unit=unit, dynamic_ncols=True, disable=not progress) as bar):
        for seed, r in decode_stream(model, ((s, prompt_of(s), s) for s in todo), params, eos, batch_size):
            text = lead + tok.decode(r.tokens[:-1] if r.finished else r.tokens)
            f.write(json.dumps({"seed": seed, "text": text, "finished": bool(r.finished)}) + "\n")
            f.flush()
            bar.update(1)


def kept_user_turns(out: Path, specials: list[str]) -> list[str]:
    """The sampled turns worth asking, in seed order: ended by the model, acceptable, each once."""
    seen, kept = set(), []
    recs = sorted((json.loads(line) for line in records(out)), key=lambda r: r["seed"])
    for r in recs:
        text = r["text"].strip()
        key = normalized(text)
        if r["finished"] and acceptable(text, specials) and key not in seen:
            seen.add(key)
            kept.append(text)
    return kept


def records(out: Path) -> list[str]:
    """A samples file's lines (none if it is missing), a torn last line (a kill) dropped from it."""
    if not out.exists():
        return []
    lines = out.read_text(encoding="utf-8").splitlines()
    good = []
    for i, line in enumerate(lines):
        try:
            json.loads(line)["seed"]
            good.append(line)
        except (ValueError, KeyError, TypeError):
            if i < len(lines) - 1:
                raise ValueError(f"{out}:{i + 1}: not a record of sampled user turns; delete the file to sample "
                                 "afresh") from None
            out.write_text("".join(x + "\n" for x in good), encoding="utf-8")  # a torn last line (a kill) goes
    return good


def _done_seeds(out: Path) -> set[int]:
    return {json.loads(line)["seed"] for line in records(out)}
