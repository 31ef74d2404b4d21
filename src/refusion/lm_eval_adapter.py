"""Moved to refusion.evaluation.lm_eval; `python -m refusion.lm_eval_adapter ...` still runs it (until 0.3)."""

from refusion.evaluation.lm_eval import *  # noqa: F401,F403
from refusion.evaluation.lm_eval import ReFusionLM, main  # noqa: F401

if __name__ == "__main__":
    main()
