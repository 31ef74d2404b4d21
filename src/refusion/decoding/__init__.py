"""Decoders: autoregressive now; plan-and-infill and the masked-diffusion baselines share DecodeResult."""

from .ar import generate_ar
from .common import DecodeResult

__all__ = ["DecodeResult", "generate_ar"]
