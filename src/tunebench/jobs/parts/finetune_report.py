"""What a fine-tuning run says: its header before training, the held-out answers it scores (task metrics), and
its summary at the end. jobs/finetune.py and jobs/grpo.py share it."""


from pathlib import Path
from typing import Any

import numpy as np
import torch

from tunebench.jobs.parts import finetune_data, runner
from tunebench.machine import metrics
from tunebench.machine.metrics import training_flops_per_token
from tunebench.model import inference, models, quality
from tunebench.settings.finetune import RunConfig
from tunebench.training import summary as summary_
from tunebench.training.autotune import compiler


def header(cfg: RunConfig, loaded: models.Loaded, parts, data, n_train: int, eval_parts, unit: str, trainable: int,
           total: int) -> str:
    """The lines above the settings table: the model, the data and its split, what trains."""
    dropped = (f"; {data.dropped} of {len(data) + data.dropped} {unit} dropped: "
               f"{finetune_data.DROPPED[cfg.objective.data != 'rows']}"
               if data.dropped else "")
    return (f"model: {loaded.source}\ndata: {' + '.join(p.config.path for p in parts) or cfg.data.path} ({data.fmt}), "
            f"{n_train} train / {sum(map(len, eval_parts))} eval {unit}{dropped}\n"
            f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.4f}%)")


def held_out_answers(cfg: RunConfig, opened: runner.Opened, model, tok, data, examples, messages, parts,
                     eval_parts) -> dict[str, Any]:
    """With --eval-generate N, the scores of the trained model's answers to N held-out rows of each dataset; a
    preference run answers its held-out prompts, scored against the chosen reply (KTO: the desirable
    completions only; an undesirable one is no answer to match)."""
    n = cfg.evaluation.eval_generate
    if not n:
        return {}
    if cfg.objective.preference:
        judged = cfg.objective.data == "judged"
        held = [i for i in np.concatenate(eval_parts) if not judged or data.labels[i]][:n]
        groups = [("pairs", [examples.answered(data.source(i)) for i in held])]
    else:
        groups = [(p.name, [messages[data.rows[i]] for i in e[:n]]) for p, e in zip(parts, eval_parts)]
    return task_scores(model, tok, [g for g in groups if g[1]], cfg, opened.out, opened.device, opened.autocast)


def summarize(cfg: RunConfig, opened: runner.Opened, plan, model, outcome: summary_.Outcome, trainable: int,
              measure_s: float) -> dict[str, Any]:
    """The run's figures: speed, MFU (FLOPs from the model's shape), memory, losses, the batch it trained with."""
    a = cfg.adapter
    matmul, layers, width = metrics.flop_dims(model)
    state = outcome.state
    seq = state.token_sq / max(state.tokens, 1)  # attention over each example's own length, not the packed row's
    fpt = training_flops_per_token(matmul, trainable, layers, width, seq, a.method == "full")
    # DPO's reference pass; KTO's, and both over its KL rows; GRPO's when beta puts a KL term in its loss
    fpt += cfg.objective.reference_forwards * (2 * matmul + 4 * layers * width * seq)  # each 2N for the matmuls, a third of attention
    summary = {
        "model": cfg.model.name, "method": a.method, "quantization": a.quantization,
        **summary_.figures(outcome, fpt, opened.hw_plan, opened.hw, opened.world), "parallel": plan.parallel,
        "trainable_parameters": trainable, "micro_batch_size": plan.micro_batch_size,
        "grad_accum_steps": plan.grad_accum_steps, "effective_batch_size": opened.effective,
        "max_length": cfg.data.max_length, "measure_s": round(measure_s, 3),
    }
    summary.update({k: v for k, v in outcome.after.items()
                    if k.startswith(("eval_loss/", "eval_rewards/", "eval_pairs", "eval_kl", "eval_examples"))})
    summary.update(cfg.objective.report())
    return summary


def task_scores(model, tok, groups: list[tuple[str, list]], cfg: RunConfig, out: Path, device: torch.device,
                autocast: torch.dtype | None) -> dict[str, Any]:
    """The trained model's answers to each dataset's held-out rows, scored (ROUGE-L, chrF, exact match, EOS
    rate) in the run's own prompt format: overall, and per dataset (rougeL/<name>, ...) when there are
    several. The answers go to eval_answers.jsonl. The model generates as it trained (inference.Placed): its
    weights as they are, under the run's autocast."""
    compiler.uncompile_blocks(model)
    model.config.use_cache = True
    rows = [r for _, group in groups for r in group]
    answers, seconds = quality.generate_answers(inference.Placed(model, tok, device, autocast), rows, cfg.data.template,
                                                cfg.evaluation.eval_max_new_tokens, seed=cfg.schedule.seed)
    scores = quality.score(answers, seconds)
    if len(groups) > 1:
        start = 0
        for name, group in groups:
            part = quality.score(answers[start:start + len(group)], seconds * len(group) / len(rows))
            scores |= {f"{k}/{name}": v for k, v in part.items()
                       if k in quality.SCORES and v is not None}
            start += len(group)
    quality.write_answers(out / "eval_answers.jsonl", answers, scores)
    shown = ", ".join(f"{k} {v}" for k, v in scores.items() if v is not None)
    print(f"answers to {len(rows)} held-out rows: {shown} (each in {out / 'eval_answers.jsonl'})")
    return scores
