"""--decoder and every decoder's parameters as flags, shared by `generate` and `eval`."""

from __future__ import annotations

import argparse

from refusion.cli.args import warn
from refusion.decoding import DECODERS


def add_decoder_flags(g: argparse.ArgumentParser) -> None:
    """--decoder and every decoder's parameters (shared by generate and eval)."""
    first = len(g._actions)
    g.add_argument("--decoder", choices=DECODERS,
                   help="default: the one the model's training objective fits: speculative for a ReFusion model, "
                        "mdm-threshold for an MDM one, ar for a model without a mask token")
    g.add_argument("--gen-length", type=int, default=128, help="tokens to generate (at most)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--seed", type=int, default=0, help="for sampling (and, in eval, the sample of examples)")
    s = g.add_argument_group("self-speculative (speculative): greedy output identical to ar, several tokens per forward")
    s.add_argument("--draft-length", type=int, default=16, help="most draft tokens verified per forward (0: plain AR)")
    s.add_argument("--mask-length", type=int, help="masks fed per forward to draft ahead (default: draft width + 1)")
    s.add_argument("--fixed-widths", action="store_true",
                   help="always feed --draft-length drafts (default: each sequence's width follows its acceptance)")
    s.add_argument("--accept-prob", type=float,
                   help="lossy: also accept a draft token whose probability is at least this (default: exact)")
    r = g.add_argument_group("plan-and-infill (refusion, refusion-l2r)")
    r.add_argument("--slot-size", type=int, default=8, help="tokens per slot")
    r.add_argument("--serial-blocks", type=int, default=1, help="blocks decoded one after another")
    r.add_argument("--slot-threshold", type=float, default=0.9, help="plan: draft confidence to take a slot")
    r.add_argument("--token-threshold", type=float, default=0.4, help="verify: probability to accept a token")
    r.add_argument("--recompute-kv", action="store_true", help="recompute infilled slots' KV (ablation)")
    m = g.add_argument_group("masked diffusion (mdm, mdm-threshold)")
    m.add_argument("--block-length", type=int, default=32, help="tokens per semi-autoregressive block")
    m.add_argument("--steps", type=int, help="total denoising steps for mdm (default: gen-length)")
    m.add_argument("--threshold", type=float, default=0.9, help="confidence threshold for mdm-threshold")
    m.add_argument("--prefix-cache", action="store_true", help="reuse the prompt's and finished blocks' KV")
    a = g.add_argument_group("sampling (ar, speculative)")
    a.add_argument("--top-k", type=int, help="sample from the k most likely tokens (needs --temperature > 0)")
    a.add_argument("--top-p", type=float, help="sample from the smallest set with this much probability "
                                                "(needs --temperature > 0)")
    # to tell the flags a user set from the defaults (decoder_params refuses set flags a decoder ignores)
    g.set_defaults(decoder_defaults={a.dest: a.default for a in g._actions[first:]})


def decoder_params(args: argparse.Namespace, decoder: str) -> dict:
    """The flags that belong to `decoder`, as keyword arguments of refusion.decoding.decode.

    A decoder flag the user set that `decoder` does not use is an error, not silently ignored.
    """
    if decoder in ("refusion", "refusion-l2r"):
        p = dict(gen_length=args.gen_length, slot_size=args.slot_size, serial_blocks=args.serial_blocks,
                 slot_threshold=args.slot_threshold, token_threshold=args.token_threshold,
                 temperature=args.temperature, recompute_kv=args.recompute_kv)
    elif decoder == "speculative":
        p = dict(gen_length=args.gen_length, draft_length=args.draft_length, mask_length=args.mask_length,
                 adaptive=not args.fixed_widths, temperature=args.temperature, top_k=args.top_k,
                 top_p=args.top_p, accept_prob=args.accept_prob)
    elif decoder in ("mdm", "mdm-threshold"):
        p = dict(gen_length=args.gen_length, block_length=args.block_length, temperature=args.temperature,
                 prefix_cache=args.prefix_cache)
        if decoder == "mdm-threshold":
            p["threshold"] = args.threshold
        elif args.steps is not None:
            p["steps"] = args.steps
    else:
        p = dict(gen_length=args.gen_length, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    used = set(p) | ({"fixed_widths"} if decoder == "speculative" else set())  # --fixed-widths is adaptive=False
    unused = [dest for dest, default in args.decoder_defaults.items()
              if dest not in used and dest not in ("decoder", "seed") and getattr(args, dest) != default]
    if unused:
        flags = ", ".join("--" + d.replace("_", "-") for d in unused)
        takes = ", ".join("--" + ("fixed-widths" if d == "adaptive" else d.replace("_", "-")) for d in p)
        raise ValueError(f"{flags} does not apply to decoder {decoder!r} (its flags: {takes})")
    return p


def choose_decoder(args: argparse.Namespace, config) -> str:
    from refusion.decoding import default_decoder, mismatch

    decoder = args.decoder or default_decoder(config)
    note = mismatch(config, decoder)
    if note:
        warn(note)
    return decoder
