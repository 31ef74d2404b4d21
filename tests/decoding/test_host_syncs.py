"""Host syncs per forward: the decoders' loops make the host wait for the device a bounded number
of times per forward, never once per token or per row (on a GPU each wait empties its queue).

A CPU waits for nothing, so runtime.count_host_syncs counts the calls that would wait on an
accelerator (item, tolist, cpu, bool, nonzero, a blocking .to(device), ...), host-side tensors
included: an upper bound. CPU-only paths (a ragged batch's `real` indices) count too, which is why
some bounds exceed what a GPU run measures (benchmarks/gpu.py reports those).
"""

import numpy as np
import pytest
import torch

from refusion.decoding import decode
from refusion.runtime import count_host_syncs, to_device
from tests.helpers.bundled import bundled, task_examples

# decoder, params, syncs per forward allowed (the setup of a decode, per call and per row, aside)
CASES = [
    ("ar", dict(max_new_tokens=48), 1.5),  # the step's tokens to the host
    ("speculative", dict(gen_length=48), 3),  # the feed to the device, the verdicts to the host
    ("refusion", dict(gen_length=48), 3),  # the same (plan-and-infill)
    ("refusion-l2r", dict(gen_length=48), 3),
    ("mdm-threshold", dict(gen_length=48, block_length=16, threshold=0.9), 5),  # "any masked left?" (+ CPU's `real`)
    ("mdm", dict(gen_length=48, block_length=16, steps=24), 5),
]


def test_count_host_syncs_counts_what_would_wait():
    x = torch.arange(4)
    with count_host_syncs("cpu") as counted:
        x[0].item(), x.tolist(), bool(x.any()), int(x[1]), x.nonzero()
        x.to("cpu"), x.to(torch.float32), x.to("cpu", non_blocking=True)  # only the first is a blocking copy
    assert counted["sync"] == 6
    assert sum(v for k, v in counted.items() if k.startswith("item ")) == 1
    with count_host_syncs("cpu") as counted:
        x + 1
    assert counted["sync"] == 0
    assert torch.Tensor.item(x[2]) == 2  # the methods are restored


def test_to_device_on_cpu():
    a = np.array([[3, 1], [4, 1]])
    t = to_device(a, torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [[3, 1], [4, 1]]
    assert to_device(a, torch.device("cpu"), torch.float32).tolist() == [[3.0, 1.0], [4.0, 1.0]]


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("decoder, params, per_forward", CASES, ids=[c[0] for c in CASES])
def test_syncs_per_forward(decoder, params, per_forward, batch):
    model, tok = bundled()
    prompts = [tok.chat_prompt_ids(ex.prompt) for ex in task_examples(per_task=1)][:batch]
    decode(model, prompts, decoder, **params)  # first use: the cost table, allocations
    forwards = [0]
    hook = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    try:
        with count_host_syncs("cpu") as counted:
            res = decode(model, prompts, decoder, **params)
    finally:
        hook.remove()
    tokens = sum(len(r.tokens) for r in res)
    assert tokens > forwards[0] or decoder in ("ar", "mdm")  # drafting decoders commit several tokens a forward
    setup = 8 + 2 * batch
    where = sorted(((v, k) for k, v in counted.items() if k != "sync"), reverse=True)[:4]
    assert counted["sync"] <= per_forward * forwards[0] + setup, (
        f"{counted['sync']} host syncs in {forwards[0]} forwards ({tokens} tokens); most at {where}")
