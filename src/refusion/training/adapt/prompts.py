"""What the adapter learns from: prompts of the kinds a model is asked, in a set mix, none from a hub or
a test split.

    prose   the model's own user turns (magpie.py): it writes the questions it expects
    maths   GSM8K's train questions (shipped in the package), as the GSM8K benchmark asks them
    code    public functions of the Python standard library, as HumanEval asks for a function, and
            the model's own function requests with tests, as MBPP asks (code_tasks.py): half each
    user    the user's own prompts (--prompts-file: one per line, or JSONL with a "query" or "prompt"),
            all of them, beside the mix

`parse_mix("prose=2,maths=1,code=2")` gives each domain's share of the budget. Every training prompt
that nearly repeats a held-out request (held_out.py) is dropped and counted: the measurement must see
requests the masks never learned from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from refusion.training.adapt import magpie
from refusion.training.adapt.code_tasks import code_tasks
from refusion.training.adapt.held_out import HeldOut, held_out_chat, held_out_code
from refusion.training.adapt.recipe import Options, estimate_seconds
from refusion.training.self_generate import Prompt, load_prompts

if TYPE_CHECKING:
    from refusion.model.tokenizer import Tokenizer
    from refusion.model.transformer import Transformer

DOMAINS = ("prose", "maths", "code")
DEFAULT_MIX = "prose=2,maths=1,code=2"
_SOURCE = {"maths": "gsm8k-train", "code": "stdlib-functions"}  # (self_generate's source names)


def parse_mix(text: str) -> dict[str, float]:
    """{"prose": 2.0, ...} from "prose=2,maths=1,code=2"; a ValueError names a bad item."""
    mix: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, share = item.partition("=")
        try:
            value = float(share) if eq else 1.0
        except ValueError:
            value = -1.0
        if name not in DOMAINS or not math.isfinite(value) or value < 0:
            raise ValueError(f"--mix: {item!r} is not DOMAIN=SHARE with a domain of {', '.join(DOMAINS)} and a share "
                             ">= 0, e.g. {DEFAULT_MIX}")
        mix[name] = value
    if not mix or sum(mix.values()) <= 0:
        raise ValueError(f"--mix: no domain has a share above 0, e.g. {DEFAULT_MIX}")
    return {k: v for k, v in mix.items() if v > 0}


def domain_counts(mix: dict[str, float], total: int) -> dict[str, int]:
    """How many prompts each domain gets of `total` (largest remainders, so they add up to it)."""
    whole = sum(mix.values())
    exact = {k: total * v / whole for k, v in mix.items()}
    counts = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: counts[k] - exact[k])[:total - sum(counts.values())]:
        counts[k] += 1
    return counts


def user_prompts(path: str | Path) -> list[str]:
    """A prompts file: JSONL of {"query"} or {"prompt"} where every line is such an object, else one
    prompt per non-empty line."""
    path = Path(path)
    try:
        lines = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    except OSError as e:
        raise ValueError(f"--prompts-file {path}: cannot read it ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--prompts-file {path}: not UTF-8 text") from None
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            return lines  # plain text
        if not isinstance(rec, dict) or not isinstance(rec.get("query", rec.get("prompt")), str):
            return lines
        out.append(rec.get("query", rec.get("prompt")))
    if not out:
        raise ValueError(f"--prompts-file {path}: no prompt in it")
    return out


def fixed_prompts(domain: str, n: int, seed: int) -> list[Prompt]:
    """The maths or code domain's n prompts (a seeded sample, as self-generate takes it)."""
    return [Prompt(domain, p.query) for p in load_prompts(_SOURCE[domain], n, seed)] if n else []


# ---- the stage --------------------------------------------------------------------------------------


def choose_prompts(model: Transformer, tok: Tokenizer, opts: Options, user: list[str], room: int, run_dir: Path,
                   batch_size: int, log: Callable[[str], None], parameters: int, progress: bool = True
                   ) -> tuple[list[Prompt], dict[str, int]]:
    """The training prompts of the mix (each once, in domain order: maths, code, prose, user), without
    near-repeats of held-out requests or prompts whose longest answer would not fit in `room` tokens;
    and how many of each were dropped. Half the code prompts are standard-library functions asked
    HumanEval's way, half the model's own function requests asked MBPP's way (code_tasks.py; all of
    them functions where its chat template cannot prompt it). The model's samples go into run_dir."""
    counts = domain_counts({d: opts.mix[d] for d in DOMAINS if opts.mix.get(d)}, opts.prompts)
    held = held_out_chat()
    out: list[Prompt] = []
    dropped = 0
    tasks = counts.get("code", 0) // 2 if _can_prompt(tok) else 0
    for domain, n in (("maths", counts.get("maths", 0)), ("code", counts.get("code", 0) - tasks)):
        chosen = fixed_prompts(domain, n, opts.seed)
        got = [p for p in chosen if not held.repeats(p.query)]
        dropped += len(chosen) - len(got)
        out += got
    if tasks:
        made, n_dropped = code_tasks(model, tok, tasks, held_out_code(), run_dir, batch_size, log, parameters,
                                     progress)
        dropped += n_dropped
        out += [Prompt("code", q) for q in made]
    if counts.get("prose"):
        kept, n_dropped = user_turns(model, tok, counts["prose"], held, run_dir / "user_turns.jsonl", batch_size,
                                     log, parameters, progress)
        dropped += n_dropped
        out += [Prompt("prose", q) for q in kept]
    mine = list(dict.fromkeys(user))
    out += [Prompt("user", q) for q in mine if not held.repeats(q)]
    dropped += sum(held.repeats(q) for q in mine)
    out = list({p.query: p for p in reversed(out)}.values())[::-1]  # each query once, first place kept
    fits = [p for p in out if len(tok.chat_prompt_ids(p.query)) + opts.max_tokens <= room]
    return fits, {"held_out_repeats_dropped": dropped, "too_long_dropped": len(out) - len(fits)}


def _can_prompt(tok: Tokenizer) -> bool:
    try:
        magpie.user_prefix_ids(tok)
    except ValueError:
        return False
    return True


def user_turns(model: Transformer, tok: Tokenizer, n: int, held: HeldOut, path: Path, batch_size: int,
               log: Callable[[str], None], parameters: int, progress: bool = True) -> tuple[list[str], int]:
    """n of the model's own user turns (fewer, said in the log, where it rarely ends one well), and how
    many kept ones nearly repeated a held-out request."""
    specials = [t.content for t in tok.tok.get_added_tokens_decoder().values() if t.content]
    drawn = math.ceil(n * 1.3) + 8  # (SmolLM2 ends about 4 turns in 5 well: a few more are drawn if short)
    while True:
        est = estimate_seconds("user turn", drawn, parameters)
        log(f"prompts: sampling {drawn} user turns from the model (first guess {est / 60:.0f} min)")
        magpie.sample_user_turns(model, tok, path, range(drawn), batch_size=batch_size, progress=progress)
        kept = magpie.kept_user_turns(path, specials)
        fresh = [t for t in kept if not held.repeats(t)]
        if len(fresh) >= n or drawn >= 4 * n + 8:
            break
        drawn = min(4 * n + 8, drawn + math.ceil(1.3 * (n - len(fresh))) + 8)
    if len(fresh) < n:
        log(f"prompts: only {len(fresh)} of {n} sampled user turns were kept (ended, well formed, new)")
    return fresh[:n], len(kept) - len(fresh)
