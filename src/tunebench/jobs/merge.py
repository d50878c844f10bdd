"""`tunebench merge`: fold an adapter (LoRA, DoRA, IA3, LoHa, LoKr) into its base and save a plain safetensors HF directory."""

from __future__ import annotations

import json
from pathlib import Path

from tunebench import inference
from tunebench.errors import TunebenchError


def merge(adapter: str, output_dir: str, model: str | None = None, allow_download: bool = False) -> Path:
    out = Path(output_dir)
    if out.exists() and any(out.iterdir()):
        raise TunebenchError(f"--output-dir '{out}' is not empty; merging never overwrites, pick a new directory")
    config = Path(adapter) / "adapter_config.json"
    peft_type = json.loads(config.read_text()).get("peft_type", "") if config.is_file() else ""
    if peft_type in ("PREFIX_TUNING", "PROMPT_TUNING"):
        raise TunebenchError(f"'{adapter}' is {peft_type.lower().replace('_', ' ')}: virtual tokens, no weights to fold "
                             "into the base; use it as it is with --adapter (generate, chat, eval)")
    loaded = inference.load_for_inference(model, adapter, None, allow_download)
    merged = loaded.model.merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    loaded.tokenizer.save_pretrained(out)
    print(f"merged {loaded.source} into {out}")
    return out
