"""A fixed amount of work to count instructions of under valgrind (machine noise does not move them).

    valgrind --tool=callgrind python benchmarks/instructions.py forward MODEL 0
    valgrind --tool=callgrind python benchmarks/instructions.py forward MODEL 200    # per forward: (N=200 - N=0) / 200
    valgrind --tool=callgrind python benchmarks/instructions.py speculative MODEL 2  # decode 8 prompts as one batch, N times

forward: single-token forwards after a 96-token cache, batch 1. A decoder name: the first 4 test
prompts of `sort` and `add`, decoded as one batch of 8 with gen_length 64 (after one warm-up decode,
so that lazy imports fall in the N=0 run). One thread. Issue 18 compared two trees this way.
"""

import sys
import warnings

import torch

warnings.simplefilter("ignore", DeprecationWarning)
# the flat layout's paths, which both layouts import, so that one script counts either tree
from refusion.model.checkpoint import load_model  # noqa: E402
from refusion.decoding import decode  # noqa: E402
from refusion.tasks import get_task  # noqa: E402
from refusion.model.tokenizer import Tokenizer  # noqa: E402

torch.set_num_threads(1)
what, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = load_model(path)
with torch.inference_mode():
    if what == "forward":
        cache = model.new_cache()
        model(torch.randint(0, 200, (1, 96)), torch.arange(96)[None], cache=cache)
        x, pos, length = torch.randint(0, 200, (1, 1)), torch.tensor([[96]]), cache.length
        for _ in range(n):
            model(x, pos, cache=cache)
            cache.length = length
    else:
        tok = Tokenizer.from_dir(path)
        prompts = [tok.chat_prompt_ids(e.prompt) for t in ("sort", "add") for e in get_task(t).load("test", n=4, seed=0)]
        decode(model, prompts[:2], what, eos_ids=model.config.eos_ids, gen_length=64)
        for _ in range(n):
            decode(model, prompts, what, eos_ids=model.config.eos_ids, gen_length=64)
