"""benchmarks/gpu.py's correctness part: outputs on a device against the ones they must equal.

- speculative_vs_ar: greedy `speculative` against greedy `ar`, token for token. Both are exact on
  the model's own arithmetic, but their forwards differ in shape (one token a row against a draft's
  width), and a device's kernels round differently by shape: where two tokens' logits are nearly
  tied the other can win. Each difference is given with the gap between the two tokens' logits in
  a plain forward of the common prefix (a near-tie shows as a gap at the dtype's rounding).
- against_record: plan-and-infill's float32 outputs on the device against the CPU's record
  (benchmarks/expected/, check_outputs.py); each setting's differing prompts with the first token
  that differs, and whether the machine's own CPU still gives the record (if not, the difference
  is torch's version, not the device). Sampled settings draw from the device's random stream,
  which differs from the CPU's: their differences are expected and said to be.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from check_outputs import EXPECTED, settings as recorded_settings
from refusion.bundled import BUNDLED
from refusion.decoding import decode
from refusion.model.checkpoint import load_model
from refusion.model.tokenizer import Tokenizer
from refusion.model.transformer import Transformer
from refusion.tasks import get_task

TASKS = ("sort", "add", "repeat", "code")  # the bundled model's task families


def task_prompts(tok: Tokenizer, n: int, seed: int = 1) -> list[list[int]]:
    """n held-out prompts of each of the bundled model's task families, as token ids."""
    return [tok.chat_prompt_ids(ex.prompt) for name in TASKS for ex in get_task(name).load("test", n=n, seed=seed)]


@torch.inference_mode()
def logit_gap(model: Transformer, prompt: list[int], prefix: list[int], a: int, b: int) -> float:
    """logit(a) - logit(b) for the token after prompt + prefix, in one plain forward (no cache)."""
    ids = torch.tensor([prompt + prefix], device=model.embed_tokens.weight.device)
    pos = torch.arange(ids.shape[1], device=ids.device)[None]
    last = model(ids, pos, num_logits=1)[0, -1].float()
    return float(last[a] - last[b])


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def speculative_vs_ar(model: Transformer, prompts: list[list[int]], batch: int, gen_length: int) -> dict:
    """Greedy speculative (the model's settings) and greedy ar on the same prompts in batches of
    `batch`: how many outputs are identical, and where and why the others part."""
    ar, spec = [], []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ar += decode(model, prompts[i:i + batch], "ar", max_new_tokens=gen_length)
            spec += decode(model, prompts[i:i + batch], "speculative", gen_length=gen_length)
    differences = []
    for k, (p, x, y) in enumerate(zip(prompts, ar, spec, strict=True)):
        at = first_difference(x.tokens, y.tokens)
        if at is None:
            continue
        d = dict(prompt=k, at=at, ar_token=x.tokens[at] if at < len(x.tokens) else None,
                 speculative_token=y.tokens[at] if at < len(y.tokens) else None, logit_gap=float("nan"))
        if d["ar_token"] is not None and d["speculative_token"] is not None:
            d["logit_gap"] = logit_gap(model, p, x.tokens[:at], d["ar_token"], d["speculative_token"])
        differences.append(d)
    return dict(batch=batch, prompts=len(prompts), same=len(prompts) - len(differences), differences=differences,
                ar_tokens=sum(len(r.tokens) for r in ar), speculative_forwards=sum(r.forwards for r in spec),
                ar_forwards=sum(r.forwards for r in ar))


def _outputs(model: Transformer, prompts: list[list[int]], decoder: str, params: dict, batch: int) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            out += [r.tokens for r in decode(model, prompts[i:i + batch], decoder, seed=0, **params)]
    return out


def against_record(device: torch.device, quick: bool, log: Callable[[str], None]) -> dict:
    """The bundled model's plan-and-infill settings of check_outputs.py, float32, on `device`, against
    the record (module doc). quick: the first setting, on the first 4 prompts at batch 1 only."""
    record = json.loads((EXPECTED / f"outputs_{BUNDLED.name}.json").read_text())
    a = record["args"]
    tok = Tokenizer.from_dir(BUNDLED)
    prompts = [tok.chat_prompt_ids(ex.prompt) for name in a["tasks"].split(",")
               for ex in get_task(name).load("test", n=a["n"], seed=1)]
    chosen = [s for s in recorded_settings(a["gen_length"]) if s[1] in ("refusion", "refusion-l2r")]
    batches = (1, 8)
    if quick:
        chosen, prompts, batches = chosen[:1], prompts[:4], (1,)
    model = load_model(BUNDLED, dtype="float32", device=device)
    cpu = model if device.type == "cpu" else None
    rows = []
    for name, decoder, params in chosen:
        for bs in batches:
            want = [r["tokens"] for r in record["outputs"][f"{name} | batch {bs}"][: len(prompts)]]
            got = _outputs(model, prompts, decoder, params, bs)
            diffs = [dict(prompt=k, at=first_difference(w, g)) for k, (w, g) in enumerate(zip(want, got, strict=True))
                     if w != g]
            cpu_ok = "-"
            if diffs and device.type != "cpu":
                cpu = cpu if cpu is not None else load_model(BUNDLED, dtype="float32", device="cpu")
                again = _outputs(cpu, prompts, decoder, params, bs)
                cpu_ok = "yes" if again == want else "no"
            elif diffs:
                cpu_ok = "no (this is the CPU)"
            row = dict(setting=f"{name} | batch {bs}", prompts=len(prompts), same=len(prompts) - len(diffs),
                       differences=diffs, cpu_matches_record=cpu_ok,
                       sampled=params.get("temperature", 0) > 0)
            if row["sampled"] and diffs and device.type != "cpu":
                row["why"] = "sampled: the device's random stream is not the CPU's"
            rows.append(row)
            log(f"  plan-and-infill {row['setting']}: {row['same']}/{row['prompts']} as the CPU's record"
                + (f", machine's CPU gives the record: {cpu_ok}" if diffs else ""))
    return dict(record=str((EXPECTED / f"outputs_{BUNDLED.name}.json").relative_to(EXPECTED.parents[1])),
                settings=rows)
