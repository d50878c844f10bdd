"""What the training jobs build a run from, out of its whole configuration: the model with its method applied and
what a resume must match (finetune_model), its rows (finetune_data), what it says at its end (finetune_report),
pretraining's model, tokenizer and blocks (pretraining) and what GRPO and RFT need around the algorithm (grpo_run).
The jobs that train (finetune, grpo, pretrain) and judge (eval, sizing) share them; training/ below takes only the
parts of a run it reads, never the run's whole configuration."""
