"""Training data: query/response records, encoding with the chat template, length batching, a small BPE.

Records use the reference's format: a JSON list, or JSONL, of {"query": str, "response": str}. The
query is wrapped in the tokenizer's chat template (as a user turn, generation prompt added); the
response is followed by EOS, unless the record says "finished": false (a self-generated response cut
at its length limit). Batches group examples of similar length (less padding) and are a pure
function of (seed, epoch), so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from refusion.model.tokenizer import MASK_TOKEN, Tokenizer

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class DataError(ValueError):
    pass


@dataclass
class Example:
    prompt: list[int]  # chat-formatted query
    response: list[int]  # response tokens + EOS

    def __len__(self) -> int:
        return len(self.prompt) + len(self.response)


# ----------------------------------------------------------------------------------------------
# records


def _check_record(rec, where: str) -> dict:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected an object with \"query\" and \"response\", got {type(rec).__name__}")
    for key in ("query", "response"):
        if key not in rec:
            raise DataError(f"{where}: record has no {key!r} field (fields: {', '.join(map(str, rec)) or 'none'})")
        if not isinstance(rec[key], str):
            raise DataError(f"{where}: {key!r} must be a string, got {type(rec[key]).__name__}")
    out = {"query": rec["query"], "response": rec["response"]}
    if "finished" in rec:  # self-generated records (training/self_generate.py): was the response ended?
        if not isinstance(rec["finished"], bool):
            raise DataError(f"{where}: 'finished' must be true or false, got {rec['finished']!r}")
        out["finished"] = rec["finished"]
    return out


def _json_list_items(text: str, path: Path):
    """(line, item) for each item of a top-level JSON list, so errors can name the line."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    line, counted = 1, 0
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text):
            raise DataError(f"{path}:{text.count(chr(10)) + 1}: the JSON list is not closed with ']'")
        if text[i] == "]":
            return
        line, counted = line + text.count("\n", counted, i), i
        try:
            item, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
        yield line, item


def load_records(path: str | Path) -> list[dict]:
    """Read {"query", "response"} records from a JSON list or a JSONL file; errors name file and line."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path} is a directory, not a JSON or JSONL file of records")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}); "
                        "records are JSON or JSONL") from None
    records = []
    if text.lstrip().startswith("["):
        records = [_check_record(r, f"{path}:{line}") for line, r in _json_list_items(text, path)]
    else:
        records = _jsonl_records(text, path)
    if not records:
        raise DataError(f"{path}: no records")
    return records


def _jsonl_records(text: str, path: Path) -> list[dict]:
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        records.append(_check_record(rec, f"{path}:{n}"))
    return records


def encode_records(records: list[dict], tokenizer: Tokenizer) -> list[Example]:
    """Chat template on each query, EOS after each response (but a response marked "finished": false,
    cut at a length limit, which must not teach an end the text never had). Queries and responses are
    text: a special token's string in them ("<|mask|>", "<|im_end|>") is read as ordinary text, so it
    never becomes a control id in a prompt, nor the mask id (or EOS) as a target."""
    eos = tokenizer.eos_id
    if eos is None:
        raise DataError("the tokenizer has no eos_token; set one in tokenizer_config.json")
    p_ids = tokenizer.chat_ids_many([[{"role": "user", "content": r["query"]}] for r in records])
    r_ids = tokenizer.encode_many([r["response"] for r in records], parse_special=False)
    return [Example(p, r + ([eos] if rec.get("finished", True) else []))
            for p, r, rec in zip(p_ids, r_ids, records, strict=True)]


def filter_by_length(examples: list[Example], max_length: int) -> tuple[list[Example], int]:
    """Keep examples of at most max_length tokens (prompt + response); return (kept, number dropped)."""
    kept = [e for e in examples if len(e) <= max_length]
    return kept, len(examples) - len(kept)


# ----------------------------------------------------------------------------------------------
# batching


def length_batches(lengths: list[int], batch_size: int, seed: int, epoch: int, pool: int = 50) -> list[list[int]]:
    """One epoch of batches (lists of example indices) grouped by length.

    Shuffle, cut into pools of `pool` batches, sort each pool by length, split it into batches and
    shuffle the batch order: little padding, yet every epoch differs. Deterministic in (seed, epoch).
    The last incomplete batch is dropped so every step has the same global batch size. pool=1: batches
    of examples drawn at random (each sorted by length inside).
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    batches = []
    step = batch_size * pool
    for start in range(0, len(idx), step):
        chunk = sorted(idx[start:start + step], key=lambda i: lengths[i])
        batches += [chunk[i:i + batch_size] for i in range(0, len(chunk) - batch_size + 1, batch_size)]
    rng.shuffle(batches)
    return batches


class BatchOrder:
    """The example indices of every step's global batch: `length_batches` of the step's epoch, built
    once per epoch (a pure function of seed and epoch, so a resumed run needs no saved order).
    grouped=False: batches of random examples (length_batches with pool=1)."""

    def __init__(self, lengths: list[int], batch_size: int, seed: int, grouped: bool = True) -> None:
        self.lengths, self.batch_size, self.seed = lengths, batch_size, seed
        self.pool = 50 if grouped else 1
        self.per_epoch = len(lengths) // batch_size
        self._epoch: tuple[int, list[list[int]]] = (-1, [])

    def __call__(self, step: int) -> list[int]:
        epoch, i = divmod(step, self.per_epoch)
        if self._epoch[0] != epoch:
            self._epoch = (epoch, length_batches(self.lengths, self.batch_size, self.seed, epoch, self.pool))
        return self._epoch[1][i]


# ----------------------------------------------------------------------------------------------
# a tokenizer for models trained from scratch


def train_bpe_tokenizer(texts: list[str], vocab_size: int = 1024, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE trained on `texts`, with ChatML special tokens and the mask token.

    Special ids: <|endoftext|> 0 (pad), <|im_start|> 1, <|im_end|> 2 (eos), <|mask|> 3.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", MASK_TOKEN]
    tok = HFTokenizer(models.BPE())
    # digits split one by one: arithmetic is easier to learn and numbers tokenise consistently
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    config = {"chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "mask_token": MASK_TOKEN, "bos_token": None, "model_max_length": 4096}
    return Tokenizer(tok, config)


def synthetic_records(n: int, seed: int = 0) -> list[dict]:
    """A mixture of the synthetic task families (refusion.tasks.synthetic) as training records."""
    from refusion.tasks.synthetic import mixture

    return [{"query": r["query"], "response": r["response"]} for r in mixture("train", n, seed)]


def task_names(data: str) -> list[str] | None:
    """The task names of a `data = "tasks:a,b,c"` source (None for any other source); errors name the
    unknown or unusable tasks in one line."""
    if not data.startswith("tasks:"):
        return None
    from refusion.tasks import all_tasks

    names = [t.strip() for t in data[len("tasks:"):].split(",") if t.strip()]
    if not names:
        raise DataError(f"data {data!r}: name at least one task, e.g. 'tasks:sort,add,repeat'")
    known = all_tasks()
    unknown = [t for t in names if t not in known]
    if unknown:
        raise DataError(f"data {data!r}: unknown task(s) {', '.join(unknown)}; known tasks: {', '.join(sorted(known))}")
    no_train = [t for t in names if "train" not in known[t].splits]
    if no_train:
        raise DataError(f"data {data!r}: task(s) {', '.join(no_train)} have no train split")
    return names


def trained_tasks(data: str) -> tuple[str, ...] | None:
    """The task families a training source draws from ("synthetic" or "tasks:a,b"); None for a file.
    Their test splits are what a model trained on it should be evaluated, tested and demonstrated on."""
    if data == "synthetic":
        from refusion.tasks.synthetic import MIXTURE

        return MIXTURE
    return tuple(task_names(data)) if data.startswith("tasks:") else None


def task_records(names: list[str], n: int, seed: int = 0) -> list[dict]:
    """n training records of the named tasks (refusion.tasks): equal shares, interleaved."""
    from refusion.tasks import get_task

    per = -(-n // len(names))
    loaded = [get_task(t).load("train", n=per, seed=seed) for t in names]
    out = [{"query": ex.prompt, "response": ex.target} for group in zip(*loaded) for ex in group]
    if any(r["response"] is None for r in out):
        raise DataError(f"tasks {', '.join(names)}: every example needs a reference response to train on")
    return out[:n]


def training_records(data: str, n: int, seed: int = 0, corpus: str | None = None, corpus_examples: int = 0) -> list[dict]:
    """The records a training run reads: `data` ("synthetic", "tasks:a,b" or a file), then, if named,
    `corpus_examples` passages of general text (refusion.training.corpus) after them (batches shuffle anyway)."""
    names = task_names(data)
    recs = (synthetic_records(n, seed) if data == "synthetic" else task_records(names, n, seed) if names
            else load_records(data))
    if corpus is not None:
        from refusion.training.corpus import corpus_records

        recs = recs + corpus_records(corpus, corpus_examples, seed)
    return recs
