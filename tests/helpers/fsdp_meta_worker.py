"""torchrun worker of test_fsdp_meta.py: set up FSDP runs that start from Hugging Face directories,
with every way of reading a whole model made to fail, and write what each process built and read;
then train one such run with `refusion train`, every whole-model read still failing.

    torchrun --nproc-per-node 2 tests/helpers/fsdp_meta_worker.py OUT CASES_JSON TRAIN_JSON

CASES_JSON: {name: [TrainConfig fields, resume]}. For each case, OUT/<name>-<rank>.json holds the
elements this process read from the safetensors files and the rows of every parameter its slice
holds, and rank 0 writes OUT/<name>.pt: every parameter gathered whole, the buffers and the model's
config. With resume, the run is checkpointed and set up again from that checkpoint, with the Hugging
Face files made unreadable: OUT/<name>-resumed.pt (and .json) hold that model. TRAIN_JSON: the
arguments of `refusion train` (one launch for both: each launch starts Python, torch and the
process group again).
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy

import refusion.model.checkpoint as checkpoint
import refusion.training.fsdp as fsdp
import refusion.training.setup as setup_module
from refusion.cli import main as refusion
from refusion.training.checkpointing import save_checkpoint
from refusion.training.config import TrainConfig
from train_worker import finish  # a torchrun script: its own folder (tests/helpers) is sys.path[0]


def refuse(*args, **kwargs):
    raise AssertionError("an FSDP setup read a whole model")


setup_module.load_model = checkpoint.load_model = checkpoint.load_state_dict = refuse
readers = []
load_hf_shards = fsdp.load_hf_shards


def recording(*args, **kwargs):
    readers.append(load_hf_shards(*args, **kwargs))
    return readers[-1]


fsdp.load_hf_shards = recording


def write(run, out: Path, name: str) -> None:
    rank = dist.get_rank()
    params = {n: p.full_tensor() for n, p in run.model.named_parameters()}
    rows = {n: fsdp.local_rows(p) for n, p in run.model.named_parameters()}
    read = readers[-1].elements_read if readers else 0
    (out / f"{name}-{rank}.json").write_text(json.dumps({"elements_read": read, "rows": rows}))
    if rank == 0:
        # (FSDP's own record of the policy each unit was sharded with)
        offload = isinstance(run.model._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
        torch.save({"params": params, "buffers": dict(run.model.named_buffers()), "offload": offload,
                    "config": dataclasses.asdict(run.model.config), "new_tokens": run.new_tokens}, out / f"{name}.pt")


def main() -> None:
    out, cases, train = Path(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
    for name, (fields, resume) in cases.items():
        readers.clear()
        run = setup_module.setup(TrainConfig(**fields))
        write(run, out, name)
        if resume:
            save_checkpoint(run)
            fsdp.load_hf_shards = refuse
            readers.clear()
            write(setup_module.setup(TrainConfig(**fields)), out, name + "-resumed")
            fsdp.load_hf_shards = recording
    rc = refusion(["train", *train])
    if rc == 0:
        dist.destroy_process_group()
    finish(rc)


if __name__ == "__main__":
    main()
