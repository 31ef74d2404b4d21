"""Training: data -> objective -> trainer -> checkpoint.

    config.py              TrainConfig: every option, from TOML / YAML and --set
    data.py                {"query", "response"} records, chat template, length-bucketed batches
    corpus.py              general text for pretraining offline (Python standard library passages)
    objectives.py          ReFusion (slot hybrid), AR and MDM as batched tensor ops
    setup.py               a run's Run: process group, tokenizer, model, data, optimizer, resumed state
    optimizer.py           AdamW and the learning-rate schedule
    step.py                one optimizer step on a global batch (micro-batches, DDP / FSDP)
    checkpointing.py       atomic checkpoints and the final model
    trainer.py             train() = fit(setup(cfg)): the loop, metrics.jsonl, exact resume
    fsdp.py                FSDP2 wrapping
    sharded_checkpoint.py  torch.distributed.checkpoint save / resume / export
    run_dir.py             a run directory: its lock, checkpoints, metrics
    config_changes.py      what a resumed run may change in its configuration
"""
