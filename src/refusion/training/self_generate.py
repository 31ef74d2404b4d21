"""Training data a model writes itself: prompts of the kind it will be used on, answered by its own
greedy decoding, so that a mask path trained on them (the mask-only variant) learns to draft what
the model will actually say.

    refusion self-generate --model smollm2 --prompts gsm8k-train,stdlib-functions --n 1000
        --max-tokens 256 --out data.jsonl

Prompt sources (`--prompts`, comma-separated; never a test split):

    gsm8k-train        GSM8K's train questions, shipped in the package (tasks/sources.py), as the GSM8K
                       benchmark asks them (tasks/maths.py gsm8k_prompt)
    gsm8k:FILE         the questions of a GSM8K-format JSONL file ("question"), asked the same way. Give
                       the train split: a file whose name says "test" is refused
    stdlib-functions   public functions of the Python standard library, signature and docstring, as
                       HumanEval asks for a function (tasks/code.py complete_function_prompt)
    stdlib-methods     public methods of its public classes, the same way (about three times as many)
    stdlib             "Continue this Python code:" passages of the standard library (training/corpus.py)
    jsonl:FILE         the "query" of every record of a {"query", "response"} file

Each source gives at most `n` prompts (a seeded sample). Each output line is {"query", "response",
"finished", "source"}: the response is the decoded greedy output without its EOS, and `finished`
says whether the model ended it (EOS) within max_tokens; training appends EOS to finished responses
only (training/data.py), so a cut answer does not teach the masks an end the model never wrote.

The file is appended to as answers finish, and queries already in it are skipped: an interrupted
run picks up where it stopped. Prompts are decoded greedily, shortest first, up to `batch_size` at a
time in one continuous batch (the `ar` decoder's: decode_stream), so that a long answer does not hold
back rows that finished; the chat template is applied as training applies it
(Tokenizer.chat_prompt_ids).
"""

from __future__ import annotations

import json
import random
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from refusion.files import Appender, write_text
from refusion.training.data import DataError, load_records

if TYPE_CHECKING:  # (torch is imported when decoding starts: `refusion --help` shows this module's docstring)
    from refusion.decoding import ARParams, DecodeResult
    from refusion.model.tokenizer import Tokenizer
    from refusion.model.transformer import Transformer

SOURCES = ("gsm8k-train", "gsm8k", "stdlib-functions", "stdlib-methods", "stdlib", "jsonl")


@dataclass
class Prompt:
    source: str
    query: str


def load_prompts(spec: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """The prompts of a comma-separated list of sources (module docstring), at most n per source,
    without repeats, in a fixed order."""
    from refusion.tasks.code import complete_function_prompt
    from refusion.tasks.maths import gsm8k_prompt
    from refusion.tasks.sources import gsm8k_train_questions
    from refusion.training.corpus import stdlib_functions, stdlib_methods, stdlib_records

    out: list[Prompt] = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, arg = item.partition(":")
        if name not in SOURCES or bool(arg) != (name in ("gsm8k", "jsonl")):
            raise DataError(f"unknown prompt source {item!r}; sources: gsm8k-train, gsm8k:FILE, stdlib-functions, "
                            "stdlib-methods, stdlib, jsonl:FILE")
        if name == "gsm8k":
            if "test" in Path(arg).name.lower():
                raise DataError(f"{arg}: a test split; self-generated training data comes from a train split")
            queries = [gsm8k_prompt(q) for q in _jsonl_field(Path(arg), "question")]
        elif name == "gsm8k-train":
            queries = [gsm8k_prompt(q) for q in gsm8k_train_questions()]
        elif name == "jsonl":
            queries = [r["query"] for r in load_records(arg)]
        elif name == "stdlib-functions":
            queries = [complete_function_prompt(code) for code in stdlib_functions(n or 10**9, seed)]
        elif name == "stdlib-methods":
            queries = [complete_function_prompt(code) for code in stdlib_methods(n or 10**9, seed)]
        else:
            queries = [r["query"] for r in stdlib_records(n or 1000, seed)]
        queries = list(dict.fromkeys(queries))  # each once, first occurrence's place
        if n is not None and len(queries) > n:
            queries = [queries[i] for i in sorted(random.Random(seed).sample(range(len(queries)), n))]
        out += [Prompt(name, q) for q in queries]
    if not out:
        raise DataError("no prompt sources given")
    return out


def _jsonl_field(path: Path, field: str) -> list[str]:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    values = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                values.append(json.loads(line)[field])
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{path}:{i}: not a JSON object with a {field!r} field") from None
    return values


def done_queries(out: Path) -> set[str]:
    """The queries an output file already answers (a torn last line, from a kill, is dropped)."""
    if not out.exists():
        return set()
    lines = out.read_text(encoding="utf-8").splitlines()
    done = set()
    for i, line in enumerate(lines):
        try:
            done.add(json.loads(line)["query"])
        except (ValueError, KeyError, TypeError):
            if i < len(lines) - 1:
                raise DataError(f"{out}:{i + 1}: not a record of a self-generated file") from None
            write_text(out, "".join(x + "\n" for x in lines[:-1]))  # the torn line goes
    return done


def decode_stream(model: Transformer, jobs: Iterable[tuple[Hashable, list[int], int]], params: ARParams,
                  eos_ids: list[int], batch_size: int) -> Iterator[tuple[Hashable, DecodeResult]]:
    """(key, result) for every job (key, prompt ids, seed) as it finishes, `ar` decoding with `params`,
    at most batch_size rows at once in one continuous batch: finished rows make room for the next jobs,
    topped up once a quarter of the batch has left (the rows that join share a prefill). A row's
    output is what `decode(model, [ids], "ar", seed=seed, **params)` gives: sampled rows draw from
    their own seed's uniforms, whatever their neighbours (speculative.generate_ar)."""
    from refusion.decoding import SpeculativeBatch
    from refusion.decoding.params import ar_batch_params, check_prompts

    p = ar_batch_params(params, model.config)
    batch, keys, todo = SpeculativeBatch(model, eos_ids), {}, iter(jobs)

    def top_up() -> None:
        while len(batch) < batch_size and (job := next(todo, None)) is not None:
            key, ids, seed = job
            check_prompts(model.config, [ids], p.gen_length)
            keys[batch.add(ids, p, seed=seed)] = key

    top_up()
    while len(batch):
        for sid, result in batch.step():
            yield keys.pop(sid), result
        if len(batch) <= batch_size - max(1, batch_size // 4):
            top_up()


def self_generate(model: Transformer, tok: Tokenizer, prompts: list[Prompt], out: str | Path, max_tokens: int = 256,
                  batch_size: int = 8, progress: bool = True) -> dict[str, int]:
    """Answer every prompt not yet in `out` with the model's greedy output; append each to `out` as it
    finishes. Returns counts: written, skipped (already there), finished, and `retokenized`, the responses
    whose text encodes to other tokens than the model wrote (training reads the text)."""
    from refusion.decoding import ARParams

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = done_queries(out)
    todo = [p for p in dict((p.query, p) for p in prompts).values() if p.query not in done]
    ids = {p.query: tok.chat_prompt_ids(p.query) for p in todo}
    todo.sort(key=lambda p: len(ids[p.query]))  # batches of similar length: little padding
    eos = tok.stop_ids(model.config.eos_ids)
    counts = dict(written=0, skipped=len(prompts) - len(todo), finished=0, retokenized=0)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="self-generate", unit="prompt", dynamic_ncols=True)
    # a line goes in whole or not at all: a full disk leaves the file at the last whole answer
    jobs = ((p, ids[p.query], 0) for p in todo)
    with Appender(out) as f:
        for p, r in decode_stream(model, jobs, ARParams(gen_length=max_tokens), eos, batch_size):
            tokens = r.tokens[:-1] if r.finished else r.tokens
            text = tok.decode(tokens)
            counts["finished"] += r.finished
            counts["retokenized"] += tok.encode(text, parse_special=False) != tokens  # as training reads it
            f.write(json.dumps({"query": p.query, "response": text, "finished": r.finished, "source": p.source})
                    + "\n")
            counts["written"] += 1
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return counts
