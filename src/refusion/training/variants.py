"""Variants of the ReFusion objective (spec section 8; docs/training.md): one TrainConfig
field, `variant`, parsed here without torch so that a config is checked before anything loads.

    paper         the paper's layout and loss (spec section 3), equal to the reference loss
    boundary      the paper's layout plus a next-token label wherever the next position's true token is
                  not visible earlier in feed order (prompt end -> first response token; a clean slot's
                  last token -> the next slot's first, when that slot is masked or fed later)
    ar-share:F    boundary, with a share F of the examples laid out with no masked slot and slots in
                  order: those examples are exactly next-token training
    joint         TiDAR-like: the response in order with next-token labels on every token, followed by
                  a copy of it as blocks of masks, each block drafting its tokens from the in-order
                  prefix before it; all weights shared (training/joint_layouts.py)
    hybrid        the ARM's example and the paper's layout of the same response in one row, the paper's
                  part blind to the in-order part: next-token training as the ARM's plus the paper's
                  objective, whole (training/joint_layouts.py)
    joint-hybrid  the joint layout, then the paper's layout of the same response blind to it: masks that
                  draft from in-order prefixes and masks and clean tokens in the paper's out-of-order
                  slots, with the ARM's example (training/joint_layouts.py)
    decoupled     the joint layout split in two: the shared weights get exactly the ARM's gradient, the
                  masks a mask embedding and adapters gated to mask rows (model/mask_adapter.py), which
                  see the shared weights and the clean keys and values detached
    mask-only     the decoupled variant's mask path alone, on a pretrained causal LM (`init`) whose every
                  weight is frozen: the draft layout's in-order part runs without gradients (its
                  next-token loss is logged, not trained) and the masks, fed on top of its keys and
                  values, train a mask embedding and adapters gated to mask rows. Every answer the base
                  gives stays the same; checkpoints and the result hold the adapters only
"""

from __future__ import annotations

from dataclasses import dataclass

from refusion.model.config import ConfigError

DEFAULT_VARIANT = "hybrid"  # learns next-token skill as fast as an ARM and keeps the paper's objective whole
VARIANTS = ("paper", "boundary", "ar-share", "joint", "hybrid", "joint-hybrid", "decoupled", "mask-only")


@dataclass(frozen=True)
class Variant:
    name: str = "paper"
    ar_share: float = 0.0  # ar-share only: the share of examples laid out as plain next-token training

    @property
    def boundary(self) -> bool:
        """Whether the paper's layout gets boundary labels (ar-share needs them: without them an
        example laid out in order would still miss every slot's first token)."""
        return self.name in ("boundary", "ar-share")

    @property
    def drafts(self) -> bool:
        """Whether the layout is the in-order response plus mask blocks (training/joint_layouts.py)."""
        return self.name in ("joint", "decoupled", "mask-only")

    @property
    def mask_path(self) -> bool:
        """Whether the run trains a mask path gated to mask rows (model/mask_adapter.py)."""
        return self.name in ("decoupled", "mask-only")


def parse_variant(text: str) -> Variant:
    """'paper', 'boundary', 'ar-share:0.25', 'joint', 'hybrid', 'joint-hybrid', 'decoupled' or 'mask-only'
    -> Variant
    (ConfigError otherwise)."""
    name, _, arg = text.partition(":")
    if name not in VARIANTS:
        raise ConfigError(f"unknown objective variant {text!r}; choose one of paper, boundary, ar-share:F "
                          "(F in (0, 1], the share of next-token examples), joint, hybrid, joint-hybrid, "
                          "decoupled, mask-only")
    if name == "ar-share":
        try:
            share = float(arg)
        except ValueError:
            raise ConfigError(f"variant {text!r}: write ar-share:F with F the share of next-token examples, "
                              "e.g. ar-share:0.25") from None
        if not 0 < share <= 1:
            raise ConfigError(f"variant {text!r}: the share must lie in (0, 1], got {share}")
        return Variant(name, share)
    if arg:
        raise ConfigError(f"variant {name!r} takes no argument, got {text!r}")
    return Variant(name)


def variant_of(cfg) -> Variant:
    """The variant a TrainConfig trains: its `variant`, or DEFAULT_VARIANT when unset; the plain layout
    ("paper", which then means "none") for objectives other than refusion."""
    if cfg.objective != "refusion":
        return Variant()
    return parse_variant(cfg.variant or DEFAULT_VARIANT)
