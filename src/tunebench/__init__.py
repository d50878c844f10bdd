"""tunebench: fine-tune and benchmark small causal language models on the hardware you have."""

import os

__version__ = "0.1.0"

_API = ("ModelConfig", "TrainingConfig", "DataConfig", "PretrainConfig", "pretrain", "load_pretrain_config", "finetune",
        "train_tokenizer", "generate")


def __getattr__(name: str):
    """The Python API (tunebench.interfaces.api), imported on first use so that `import tunebench` stays light."""
    if name in _API:
        from tunebench.interfaces import api
        return getattr(api, name)
    raise AttributeError(f"module 'tunebench' has no attribute {name!r}")

# Whether the user chose torch's compiler cache: read now, because torch writes its /tmp default
# into the environment the first time it looks (`compiler.compile_blocks` moves it next to ours).
USER_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR" in os.environ
