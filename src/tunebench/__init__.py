"""tunebench: fine-tune and benchmark small causal language models on the hardware you have."""

from tunebench.core import VERSION as __version__  # noqa: F401 - the package's version, where tools look
from tunebench.core import startup as _startup  # noqa: F401 - its USER_INDUCTOR_CACHE is read as the package loads

_API = ("ModelConfig", "TrainingConfig", "DataConfig", "PretrainConfig", "pretrain", "load_pretrain_config", "finetune",
        "train_tokenizer", "generate")


def __getattr__(name: str):
    """The Python API (tunebench.interfaces.api), imported on first use so that `import tunebench` stays light."""
    if name in _API:
        from tunebench.interfaces import api
        return getattr(api, name)
    raise AttributeError(f"module 'tunebench' has no attribute {name!r}")
