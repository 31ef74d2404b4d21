"""The bundled model's four task families as an offline lm-eval task group (refusion_tasks.yaml).

lm-eval loads each family's rows with `load` (the YAMLs' `custom_dataset`) from refusion_tasks.jsonl
beside this file, so the task works from any directory and needs no dataset hub. The JSONL holds
held-out prompts: `refusion eval`'s test split (seed 0), 25 per family, in the order `refusion eval
--n 25` asks them. Regenerate it with `python configs/lm_eval/refusion_tasks.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

ROWS = Path(__file__).with_suffix(".jsonl")
FAMILIES = ("sort", "add", "repeat", "code")
PER_FAMILY = 25


def load(family: str, **metadata):
    """The rows of one family as lm-eval's dataset: {"test": prompt, target}. `metadata` is what
    lm-eval passes along to every custom loader (--metadata, the task's version); unused."""
    import datasets

    rows = [r for r in map(json.loads, ROWS.read_text().splitlines()) if r["family"] == family]
    if not rows:
        raise ValueError(f"no rows of family {family!r} in {ROWS}")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def rows() -> list[dict]:
    from refusion.tasks import get_task

    return [{"family": name, "prompt": ex.prompt, "target": ex.target}
            for name in FAMILIES for ex in get_task(name).load("test", n=PER_FAMILY, seed=0)]


if __name__ == "__main__":
    ROWS.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    print(f"wrote {ROWS}")
