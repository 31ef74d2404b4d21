"""torchrun worker: several `refusion train` command lines run one after another in the same
processes, so that a test pays once, not once a run, for starting Python, torch and the process group.

    torchrun --nproc-per-node N tests/helpers/train_worker.py LOG JOBS_JSON

JOBS_JSON: {name: the arguments of `refusion train`}. Each job runs as that command line does
(refusion.cli.main), in the process group the first one joins. After each job rank 0 writes LOG:
{name: {"rc": its exit status, "stderr": what it wrote on stderr}}. A job that fails ends the launch
with its status, as it would end a launch of its own (train_helpers.torchrun_train launches this).
The processes end without the interpreter's teardown, which takes seconds once torch is imported.
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from refusion.cli import main as refusion


def finish(status: int) -> None:
    """End this process now (every file it wrote is closed), skipping the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main() -> None:
    log, jobs = Path(sys.argv[1]), json.loads(sys.argv[2])
    done = {}
    for name, args in jobs.items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = refusion(["train", *args])
        done[name] = {"rc": rc, "stderr": err.getvalue()}
        if os.environ["RANK"] == "0":
            log.write_text(json.dumps(done))
        if rc != 0:
            finish(rc)
    dist.destroy_process_group()
    finish(0)


if __name__ == "__main__":
    main()
