"""tunebench: fine-tune and benchmark small causal language models on the hardware you have."""

import os

__version__ = "0.1.0"

# Whether the user chose torch's compiler cache: read now, because torch writes its /tmp default
# into the environment the first time it looks (`models.compile_blocks` moves it next to ours).
USER_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR" in os.environ
