"""Code the tests share: reference implementations, tiny models, a live server, training launchers,
and the scripts subprocesses run (train_worker.py and fsdp_meta_worker.py under torchrun,
forked_cli.py as the study script's fork server)."""
