"""`refusion train-sampler`: a mask sampler for a model whose masks draft (refusion.training.mask_sampler)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from refusion.cli.args import positive_int


DESCRIPTION = """\
Train a mask sampler (refusion/model/mask_sampler.py) for a model whose masks draft: a small head that
chooses each mask's draft among its most likely tokens given the token drafted before it, so that a
block's drafts hold together further. The model stays frozen; what the sampler learns from (masks
behind random prefixes of the data's answers) is computed once into OUT/features.pt, which a cut run
resumes from; the sampler kept is the one whose drafts held longest on held-out examples
(refusion/training/mask_sampler.py). Greedy speculative output stays the model's own either way."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("train-sampler", help="train a sampler that chains the masks' drafts (speculative decoding "
                       "accepts them further; answers unchanged)", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("adapter", help="the mask adapter directory (mask_adapter.json) or model directory whose masks "
                   "draft; the sampler is written into it as mask_sampler.safetensors")
    s.add_argument("--data", required=True, help="JSONL of {query, response}: the answers the masks learned "
                   "from (refusion self-generate's output), never a test split")
    s.add_argument("--out", help="where the features and the run's record go (default: ADAPTER/sampler-run)")
    s.add_argument("--examples", type=positive_int, help="a seeded sample of the data (default: all)")
    s.add_argument("--cuts", type=positive_int, default=16, help="prefixes per example whose masks are kept")
    s.add_argument("--steps", type=positive_int, default=3000, help="optimizer steps")
    s.add_argument("--check-every", type=positive_int, default=250,
                   help="steps between checks on the held-out examples (the best check's sampler is kept)")
    s.add_argument("--threads", type=positive_int, help="CPU threads (default: torch's)")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.set_defaults(func=cmd_train_sampler)


def cmd_train_sampler(args: argparse.Namespace) -> None:
    import random

    from refusion.bundled import resolve_model
    from refusion.model.checkpoint import load_model
    from refusion.model.mask_sampler import save_sampler
    from refusion.model.tokenizer import Tokenizer
    from refusion.runtime import set_threads
    from refusion.training.data import encode_records, load_records
    from refusion.training.mask_sampler import SamplerTraining, sampler_features, train_sampler

    target = Path(args.adapter)
    if not target.is_dir():
        raise ValueError(f"{target}: no such directory (a mask adapter or model directory)")
    records = load_records(args.data)  # bad data fails before the model loads
    if args.examples is not None and args.examples < len(records):
        records = random.Random(0).sample(records, args.examples)
    model_dir = resolve_model(str(target))
    model, tok = load_model(model_dir), Tokenizer.from_dir(model_dir)
    if model.config.mask_token_id is None or model.mask_embedding is None:
        raise ValueError(f"{target}: the model has no mask path (mask adapter) whose drafts a sampler could chain")
    set_threads(args.threads)
    out = Path(args.out) if args.out else target / "sampler-run"
    out.mkdir(parents=True, exist_ok=True)
    cfg = SamplerTraining(cuts=args.cuts, steps=args.steps, check_every=args.check_every)
    features = sampler_features(model, encode_records(records, tok), cfg, out / "features.pt",
                                progress=not args.no_progress)
    sampler, record = train_sampler(model, features, cfg, progress=not args.no_progress)
    (out / "sampler.json").write_text(json.dumps(record, indent=1))
    path = save_sampler(sampler, target)
    print(f"{path}: held-out drafts accepted in a row {record['best_chain']:.3f} against the argmax's "
          f"{record['argmax_chain']:.3f} (step {record['best_step']}); record {out / 'sampler.json'}", file=sys.stderr)
    print(path)
