"""`tunebench merge`: fold an adapter (LoRA, DoRA, IA3, LoHa, LoKr) into its base and save a plain safetensors HF
directory; or, given several LoRA adapters of one base, combine them into one adapter with PEFT's
add_weighted_adapter (linear, cat, ties, dare_ties, magnitude_prune), which generate, chat, serve, eval and
export load like any run."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tunebench.core.durable import atomic_dir
from tunebench.core.errors import TunebenchError
from tunebench.data import formats
from tunebench.jobs.generate import trained_template
from tunebench.model import inference, quality
from tunebench.settings.finetune import load_config
from tunebench.settings.rundir import RunDir

COMBINATIONS = ("linear", "cat", "ties", "dare_ties", "magnitude_prune")
NEEDS_DENSITY = ("ties", "dare_ties", "magnitude_prune")


def run(adapters: list[str], output_dir: str, model: str | None = None, allow_download: bool = False,
        weights: list[float] | None = None, combination: str = "linear", density: float | None = None,
        eval_data: list[str] | None = None, eval_rows: int = 16) -> Path:
    """`tunebench merge`: one adapter folded into its base, or several combined into one adapter (then, with
    `eval_data`, each task scored by its own adapter and by the combination)."""
    if len(adapters) == 1:
        return merge(adapters[0], output_dir, model, allow_download)
    if eval_data and len(eval_data) != len(adapters):
        raise TunebenchError(f"--eval-data gives {len(eval_data)} dataset(s) for {len(adapters)} adapters; "
                             "give one per adapter, in the same order")
    if eval_rows < 1:
        raise TunebenchError(f"--eval-rows must be 1 or more, got {eval_rows}")
    for path in eval_data or []:  # refused now if unreadable, not after the combination
        _examples(path)
    out = combine(adapters, output_dir, weights, combination, density, model, allow_download)
    if eval_data:
        print(before_and_after(adapters, out, eval_data, eval_rows))
    return out


def _examples(path: str):

    return formats.load_examples(load_config(options={"data.path": path}).data)


def merge(adapter: str, output_dir: str, model: str | None = None, allow_download: bool = False) -> Path:
    out = Path(output_dir)
    if out.exists() and any(out.iterdir()):
        raise TunebenchError(f"--output-dir '{out}' is not empty; merging never overwrites, pick a new directory")
    peft_type = RunDir(adapter).peft_type() or ""
    if peft_type in ("PREFIX_TUNING", "PROMPT_TUNING"):
        raise TunebenchError(f"'{adapter}' is {peft_type.lower().replace('_', ' ')}: virtual tokens, no weights to fold "
                             "into the base; use it as it is with --adapter (generate, chat, eval)")
    loaded = inference.load_for_inference(model, adapter, None, allow_download)
    merged = loaded.model.merge_and_unload()
    with atomic_dir(out) as tmp:  # the merged model appears whole, or not at all
        merged.save_pretrained(tmp, safe_serialization=True)
        loaded.tokenizer.save_pretrained(tmp)
    print(f"merged {loaded.source} into {out}")
    return out


def combine(adapters: list[str], output_dir: str, weights: list[float] | None = None, combination: str = "linear",
            density: float | None = None, model: str | None = None, allow_download: bool = False) -> Path:
    """Several LoRA adapters of one base as one new adapter directory."""
    out = Path(output_dir)
    weights = weights or [1.0 / len(adapters)] * len(adapters)
    check_combination(adapters, out, weights, combination, density)
    templates = {trained_template(a) for a in adapters}
    if len(templates) > 1:
        raise TunebenchError(f"the adapters were trained with different prompt formats ({', '.join(map(repr, templates))}); "
                             "a combined adapter answers one format: combine adapters trained with the same --template")
    bases = {_resolved(inference.trained_on(a)) for a in adapters}
    if len(bases) > 1 and model is None:
        raise TunebenchError(f"the adapters were trained on different base models ({', '.join(sorted(bases))}); "
                             "only adapters of one base combine")

    names = [f"adapter_{i}" for i in range(len(adapters))]
    loaded = inference.load_for_inference(model, adapters[0], None, allow_download)  # the base, loaded once
    peft_model = loaded.model
    for name, path in zip(names, adapters):
        peft_model.load_adapter(path, adapter_name=name)
    extra = {"density": density} if combination in NEEDS_DENSITY else {}
    peft_model.delete_adapter("default")
    peft_model.add_weighted_adapter(names, weights, "default", combination_type=combination, **extra)
    for name in names:
        peft_model.delete_adapter(name)
    with atomic_dir(out) as tmp:
        peft_model.save_pretrained(tmp)
        loaded.tokenizer.save_pretrained(tmp)
        # what generate, eval and export read from a run directory: its base and its prompt format
        (tmp / "config.yaml").write_text(yaml.safe_dump({
            "model": {"name": inference.trained_on(adapters[0])}, "data": {"template": templates.pop()},
            "combined": {"adapters": [str(Path(a).resolve()) for a in adapters], "weights": weights,
                         "combination": combination, **extra}}, sort_keys=False))
    print(f"combined {len(adapters)} adapters ({combination}, weights {', '.join(f'{w:g}' for w in weights)}"
          f"{f', density {density:g}' if density is not None else ''}) into {out}")
    return out


def before_and_after(adapters: list[str], combined: Path, eval_data: list[str], rows: int = 16,
                     max_new_tokens: int = 64) -> str:
    """Each task's metric (exact match on GSM8K-style data, else ROUGE-L) from its own adapter and from the
    combined one, on the same rows: what combining cost or gained each task."""
    template = trained_template(str(combined))
    together = inference.load(None, str(combined))  # once, for every task
    lines = ["task (data)                 metric       its adapter   combined"]
    for adapter, path in zip(adapters, eval_data):
        examples = _examples(path).messages[:rows]
        scores = []
        for placed in (inference.load(None, adapter), together):
            answers, seconds = quality.generate_answers(placed, examples, template, max_new_tokens)
            scores.append(quality.score(answers, seconds))
        metric = "exact_match" if scores[0]["exact_match"] is not None else "rougeL"
        lines.append(f"{Path(path).name[:27]:<28}{metric:<13}{scores[0][metric]:>11.1f}{scores[1][metric]:>11.1f}")
    return "\n".join(lines)


def _resolved(spec: str) -> str:
    return str(Path(spec).resolve()) if Path(spec).exists() else spec


def check_combination(adapters: list[str], out: Path, weights: list[float], combination: str,
                      density: float | None) -> None:
    """Everything PEFT would refuse late, or a user could get wrong, refused before a model loads."""
    if combination not in COMBINATIONS:
        raise TunebenchError(f"--combination '{combination}' is not one of {', '.join(COMBINATIONS)}")
    if len(weights) != len(adapters):
        raise TunebenchError(f"--weights gives {len(weights)} weight(s) for {len(adapters)} adapters; give one each")
    if combination in NEEDS_DENSITY and (density is None or not 0 < density <= 1):
        raise TunebenchError(f"--combination {combination} keeps a share of each adapter's weights: pass "
                             f"--density between 0 and 1 (PEFT's examples use 0.2), got {density}")
    if out.exists() and any(out.iterdir()):
        raise TunebenchError(f"--output-dir '{out}' is not empty; merging never overwrites, pick a new directory")
    ranks = set()
    for a in adapters:
        config = Path(a) / "adapter_config.json"
        if not config.is_file():
            raise TunebenchError(f"'{a}' holds no adapter_config.json; point --adapter at a training run's --output-dir")
        c = json.loads(config.read_text())
        if c.get("peft_type") != "LORA" or c.get("use_dora"):
            kind = "DORA" if c.get("use_dora") else c.get("peft_type")
            raise TunebenchError(f"'{a}' is a {kind} adapter; PEFT combines LoRA adapters only (train with "
                                 "--method lora or qlora)")
        ranks.add(c.get("r"))
    if combination != "cat" and len(ranks) > 1:
        raise TunebenchError(f"--combination {combination} needs adapters of one rank, these have r = "
                             f"{', '.join(map(str, sorted(ranks)))}; use --combination cat (ranks add up)")
