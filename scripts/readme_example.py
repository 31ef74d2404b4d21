"""The README's example, regenerated honestly: a held-out prompt and what the default model says to it.

    python scripts/readme_example.py                    # the bundled model, its default decoder
    python scripts/readme_example.py --task add --index 3 --n 100

It takes a prompt from a task's test split (never drawn for training: the split is a hash of the
prompt's text), checks that the bundled model's training data (its recipe.toml: the records it names,
same count and seed) does not contain it, runs `refusion generate` on it exactly as the README shows,
and prints the command and its output. Then it decodes --n held-out prompts of every task the recipe
trains on with the same decoder and settings, and prints the TPF and accuracy a README may quote: what
the model reaches on prompts it has not seen, not on one it memorised.

The prompt is the test split's example --index (in the split's seeded order), whatever the model
answers: it is not chosen for a good answer.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from refusion.model.checkpoint import load_model  # noqa: E402
from refusion.bundled import BUNDLED  # noqa: E402
from refusion.training.data import trained_tasks, training_records  # noqa: E402
from refusion.decoding import default_decoder  # noqa: E402
from refusion.evaluation.evaluate import EvalConfig, evaluate  # noqa: E402
from refusion.runtime import count_parameters, set_threads  # noqa: E402
from refusion.tasks import get_task  # noqa: E402

GEN_LENGTH = 128  # `refusion generate`'s default


def recipe_tasks(recipe: dict) -> tuple[str, ...]:
    names = trained_tasks(recipe.get("data", "synthetic"))
    if names is None:
        raise SystemExit(f"the recipe trains on the file {recipe['data']}, not on tasks with test splits")
    return names


def training_prompts(recipe: dict) -> set[str]:
    """The queries the recipe trains on (the same records, count and seed as `refusion train`)."""
    recs = training_records(recipe.get("data", "synthetic"), recipe.get("synthetic_examples", 20000),
                            recipe.get("seed", 0), recipe.get("corpus"), recipe.get("corpus_examples", 20000))
    return {r["query"] for r in recs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="code", help="task of the example prompt (one the recipe trains on)")
    ap.add_argument("--index", type=int, default=0, help="which test example (seeded order)")
    ap.add_argument("--n", type=int, default=50, help="held-out prompts per task for the TPF line")
    ap.add_argument("--recipe", default=str(BUNDLED / "recipe.toml"),
                    help="the bundled model's training recipe (to check the prompt is not in its data)")
    args = ap.parse_args()
    recipe = tomllib.loads(Path(args.recipe).read_text())
    tasks = recipe_tasks(recipe)
    if args.task not in tasks:
        raise SystemExit(f"--task {args.task}: the recipe trains on {', '.join(tasks)}")

    prompt = get_task(args.task).load("test", n=args.index + 1, seed=0)[args.index].prompt
    seen = training_prompts(recipe)
    if prompt in seen:
        raise SystemExit(f"the prompt is in the training data: {prompt!r}")
    cmd = [sys.executable, "-m", "refusion.cli", "generate", prompt, "--no-view"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if p.returncode != 0:
        raise SystemExit(p.stderr)
    print("```")
    print(f"$ refusion generate {shlex.quote(prompt)}")
    print(p.stdout.rstrip())
    print(p.stderr.rstrip())
    print("```")
    print(f"(test split of {args.task!r}, example {args.index}; not among the {len(seen)} training prompts)\n")

    model = load_model(BUNDLED)
    set_threads(None, count_parameters(model))
    from refusion.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(BUNDLED)
    decoder = default_decoder(model.config)
    tokens = forwards = 0
    parts = []
    for name in tasks:
        s = evaluate(model, tok, get_task(name), EvalConfig(decoder, {"gen_length": GEN_LENGTH}, n=args.n),
                     progress=False)
        tokens, forwards = tokens + s["tokens"], forwards + s["forwards"]
        parts.append(f"{name} {s['tpf']:.2f} ({100 * s['accuracy']:.0f}% correct)")
    print(f"Held-out prompts ({args.n} per task from the test splits, greedy, gen_length {GEN_LENGTH}, "
          f"decoder {decoder}): TPF {tokens / forwards:.2f} overall; " + ", ".join(parts) + ".")


if __name__ == "__main__":
    main()
