"""The one place the server imports the continuous-batching decoder from.

TEMPORARY: refusion.decoding.speculative is being written on main; until it lands, a stand-in with
the same interface (an autoregressive batch, _standin.py) lets the HTTP layer be built and tested.
Both this fallback and _standin.py go once `git merge main` brings the real module.
"""

try:
    from ..decoding.speculative import SpeculativeBatch, SpeculativeParams
except ImportError:  # pragma: no cover - removed with the stand-in
    from ._standin import SpeculativeBatch, SpeculativeParams

__all__ = ["SpeculativeBatch", "SpeculativeParams"]
