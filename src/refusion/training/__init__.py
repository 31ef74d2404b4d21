"""Training: data -> objective -> trainer -> checkpoint.

    config.py              TrainConfig: every option, from TOML / YAML and --set
    data.py                {"query", "response"} records, chat template, length-bucketed batches
    corpus.py              general text for pretraining offline (Python standard library passages)
    objectives.py          ReFusion (slot hybrid), AR and MDM as batched tensor ops
    trainer.py             the training loop, atomic checkpoints, exact resume
    fsdp.py                FSDP2 wrapping
    sharded_checkpoint.py  torch.distributed.checkpoint save / resume / export
    run_dir.py             run directories
"""
