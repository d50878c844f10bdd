"""The `tunebench` command: options -> config -> job. Problems become one-line errors."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from typing import Any

from tunebench import __version__
from tunebench.errors import TunebenchError

# (flags, config key, help). The reference study's underscore spellings are aliases.
TRAIN_OPTIONS: list[tuple[tuple[str, ...], str, str]] = [
    (("--model", "--model_name"), "model.name",
     "preset (smollm2-135m-instruct [default], gpt2-124m, tiny), hub id, HF directory or .gguf file"),
    (("--tokenizer",), "model.tokenizer", "tokenizer directory or id, when not the model's own"),
    (("--data", "--dataset"), "data.path",
     "CSV, JSON, JSONL, Parquet or saved datasets dir (default: built-in customer-support sample); several "
     "--data FILE:WEIGHT train on a mixture"),
    (("--format",), "data.format", "auto | instruction | alpaca | question | chat | text (default auto: from the columns)"),
    (("--instruction-column",), "data.instruction_column", "prompt column of instruction data (default instruction)"),
    (("--response-column",), "data.response_column", "answer column of instruction data (default response)"),
    (("--template",), "data.template",
     "auto (the tokenizer's chat template if any) or a prompt such as '### Q:\\n{instruction}\\n### A:\\n'"),
    (("--train-on",), "data.train_on", "response (loss on answers only, default) | all"),
    (("--max-samples", "--max_samples"), "data.max_samples", "use a seeded random subset of this many rows"),
    (("--max-length", "--max_length"), "data.max_length", "truncate examples to this many tokens (default 128)"),
    (("--packing",), "data.packing",
     "auto (packed or length-grouped rows, whichever leaves the least padding) | on | off (off: may still "
     "group by length)"),
    (("--eval-fraction",), "data.eval_fraction", "share of rows held out for eval loss (default 0.05)"),
    (("--output-dir", "--output_dir"), "train.output_dir", "where the adapter/model, metrics and checkpoints go"),
    (("--method",), "adapter.method",
     "lora (default) | qlora | dora | ia3 | loha | lokr | prefix | prompt (PEFT methods) | full"),
    (("--lora-r", "--lora_r", "--rank"), "adapter.r", "rank of lora, qlora, dora, loha, lokr (default 8)"),
    (("--lora-alpha", "--lora_alpha"), "adapter.lora_alpha", "alpha of lora, qlora, dora, loha, lokr (default 16)"),
    (("--lora-dropout", "--lora_dropout"), "adapter.lora_dropout", "LoRA dropout (default 0.1)"),
    (("--target-modules",), "adapter.target_modules",
     "auto (attention projections) | all-linear | comma-separated module names"),
    (("--quantization",), "adapter.quantization", "none | 4bit (nf4, QLoRA) | 8bit"),
    (("--num-virtual-tokens",), "adapter.num_virtual_tokens", "virtual tokens of prefix and prompt tuning (default 20)"),
    (("--prompt-init-text",), "adapter.prompt_init_text",
     "prompt tuning: start the virtual tokens from this text's embeddings (default: random)"),
    (("--epochs", "--num_epochs"), "train.epochs", "passes over the training rows (default 1)"),
    (("--max-steps",), "train.max_steps", "stop after this many optimizer steps (overrides --epochs)"),
    (("--max-tokens",), "train.max_tokens",
     "a token budget: train the steps that see about this many real tokens (overrides --epochs)"),
    (("--batch-size", "--batch_size"), "train.micro_batch_size",
     "micro batch size, or auto (default): measure the sizes that divide the effective batch, keep the fastest"),
    (("--grad-accum", "--gradient_accumulation_steps"), "train.grad_accum_steps",
     "gradient accumulation steps (default: effective batch / micro batch)"),
    (("--effective-batch-size",), "train.effective_batch_size", "samples per optimizer step (default 8)"),
    (("--lr", "--learning_rate"), "train.lr", "peak learning rate (default 2e-4)"),
    (("--weight-decay",), "train.weight_decay", "AdamW weight decay (default 0)"),
    (("--warmup-ratio",), "train.warmup_ratio", "share of steps for linear warm-up (default 0.03)"),
    (("--schedule",), "train.schedule", "cosine (default) | linear | constant | warmup_stable_decay"),
    (("--max-grad-norm",), "train.max_grad_norm", "gradient clipping norm (default 1.0)"),
    (("--precision",), "train.precision", "auto (default) | fp32 | bf16 | fp16"),
    (("--device",), "train.device", "auto (default) | cpu | cuda | mps"),
    (("--threads",), "train.threads",
     "torch CPU threads (default: OMP_NUM_THREADS, else one per physical core this process may use)"),
    (("--parallel",), "train.parallel",
     "under torchrun / tunebench launch: auto (default: DDP; FSDP2 for full fine-tuning that does not fit a rank) "
     "| ddp | fsdp"),
    (("--backend",), "train.backend", "torch.distributed backend: auto (nccl on CUDA, gloo on CPU) | gloo | nccl"),
    (("--seed",), "train.seed", "seed for data order, split and initialisation (default 42)"),
    (("--logging-steps",), "train.logging_steps", "write metrics every N steps (default 1)"),
    (("--eval-steps",), "train.eval_steps",
     "eval loss every N steps, or below 1 a share of the steps (0.25: 4 evals; default: before and after training)"),
    (("--eval-generate",), "train.eval_generate",
     "at the end, answer N held-out rows and score them: ROUGE-L, chrF, exact match (GSM8K), EOS rate (default 0)"),
    (("--eval-max-new-tokens",), "train.eval_max_new_tokens", "the cap on each of those answers (default 128)"),
    (("--save-steps", "--save_steps"), "train.save_steps", "checkpoint every N steps (default: at the end)"),
    (("--save-total-limit",), "train.save_total_limit", "keep the newest N checkpoints (default 2)"),
    (("--resume",), "train.resume", "auto (newest checkpoint in --output-dir) or a checkpoint path"),
    (("--report-to",), "train.report_to", "none (default) | tensorboard"),
]


PRETRAIN_OPTIONS = [
    (("--data",), "data.train_file", "training text: file(s), comma-separated, or a directory"),
    (("--tokenizer",), "data.tokenizer", "tokenizer directory (default: byte-level BPE trained on --data)"),
    (("--output-dir", "--output_dir"), "training.checkpoint_dir", "run directory (default runs/pretrain)"),
    (("--max-steps",), "training.max_steps", "stop after this many optimizer steps"),
    (("--max-tokens",), "training.max_tokens", "a token budget: train the steps that see about this many tokens"),
    (("--batch-size",), "training.batch_size", "micro batch, or auto (measure those dividing --effective-batch-size)"),
    (("--effective-batch-size",), "training.effective_batch_size", "blocks per optimizer step"),
    (("--lr",), "training.learning_rate", "peak learning rate"),
    (("--max-length",), "data.max_length", "tokens per block"),
    (("--device",), "training.device", "auto (default) | cpu | cuda | mps"),
    (("--threads",), "training.threads", "torch CPU threads (default: OMP_NUM_THREADS, else the usable cores)"),
    (("--precision",), "training.precision", "auto (default) | fp32 | bf16 | fp16"),
    (("--compile",), "training.compile", "torch.compile: auto (default) | on | off"),
    (("--compile-mode",), "training.compile_mode", "torch.compile's mode: default | reduce-overhead | max-autotune"),
    (("--attention",), "training.attention", "auto (fastest measured) | sdpa | eager | tunebench | flash_attention_2"),
    (("--eval-steps",), "training.eval_steps",
     "validation loss and a sample every N steps, or below 1 a share of the steps (0.25: 4 evals)"),
    (("--save-steps",), "training.save_steps", "checkpoint every N steps"),
    (("--parallel",), "training.parallel", "under torchrun / tunebench launch: auto | ddp | fsdp"),
    (("--backend",), "training.backend", "torch.distributed backend: auto (nccl on CUDA, gloo on CPU) | gloo | nccl"),
    (("--seed",), "training.seed", "seed for initialisation, split and data order"),
    (("--resume",), "training.resume", "auto (newest checkpoint in --output-dir) or a checkpoint path"),
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, like every other input error
        raise TunebenchError(f"{message}; see `{self.prog} --help`")


def _add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tunebench", description="Fine-tune and benchmark small causal LMs on the hardware you have.")
    parser.add_argument("--version", action="version", version=f"tunebench {__version__}")
    _add_debug(parser)
    sub = parser.add_subparsers(dest="job", parser_class=_Parser, metavar="JOB")

    train = sub.add_parser("train", help="LoRA, QLoRA or full fine-tuning",
                           description="Fine-tune a causal LM. Positional items: an optional CONFIG.yaml and "
                                       "dotted overrides such as train.lr=1e-4.")
    train.add_argument("items", nargs="*", metavar="CONFIG.yaml|key=value")
    for flags, key, help_text in TRAIN_OPTIONS:
        # --data may be given several times, each FILE:WEIGHT: a mixture (data.sources)
        train.add_argument(*flags, dest=key, default=argparse.SUPPRESS, help=help_text, metavar="V",
                           **({"action": "append"} if key == "data.path" else {}))
    train.add_argument("--profile", default=None, metavar="NAME",
                       help="hardware profile to start from: cpu, gpu-8-12gb, gpu-24gb, gpu-80gb (or a YAML path)")
    train.add_argument("--compile", dest="train.compile", default=argparse.SUPPRESS, metavar="V",
                       help="torch.compile: auto (default) | on | off")
    train.add_argument("--compile-mode", dest="train.compile_mode", default=argparse.SUPPRESS, metavar="V",
                       help="torch.compile's mode: default | reduce-overhead | max-autotune")
    train.add_argument("--attention", dest="train.attention", default=argparse.SUPPRESS, metavar="V",
                       help="attention kernel: auto (the fastest measured of sdpa, eager, tunebench and, on a CUDA GPU "
                            "with flash-attn installed, flash_attention_2) | sdpa | eager | tunebench | flash_attention_2")
    train.add_argument("--liger", dest="train.liger", default=argparse.SUPPRESS, metavar="V",
                       help="Liger's Triton RMSNorm/RoPE/SwiGLU kernels: auto (on a CUDA GPU when liger-kernel is "
                            "installed) | on | off")
    train.add_argument("--gradient-checkpointing", dest="train.gradient_checkpointing", default=argparse.SUPPRESS,
                       metavar="V", help="auto (only when the batch would not fit) | on | off")
    train.add_argument("--lr-scaling", dest="train.lr_scaling", default=argparse.SUPPRESS, metavar="V",
                       help="none (default) | linear | sqrt: scale --lr by effective batch / train.lr_reference_batch")
    train.add_argument("--use_8bit", "--use-8bit", dest="adapter.quantization", action="store_const", const="8bit",
                       default=argparse.SUPPRESS, help="alias of --quantization 8bit")
    train.add_argument("--use_4bit", "--use-4bit", dest="adapter.quantization", action="store_const", const="4bit",
                       default=argparse.SUPPRESS, help="alias of --quantization 4bit")
    train.add_argument("--allow-download", dest="model.allow_download", action="store_const", const=True,
                       default=argparse.SUPPRESS, help="let transformers fetch a hub model that is not cached")
    train.add_argument("--overwrite", dest="train.overwrite", action="store_const", const=True,
                       default=argparse.SUPPRESS, help="replace an earlier run in --output-dir")
    train.add_argument("--no-progress", dest="train.progress", action="store_const", const=False,
                       default=argparse.SUPPRESS, help="no progress bar (logs only)")
    _add_debug(train)

    pre = sub.add_parser("pretrain", help="train a causal LM from scratch (its own tokenizer, a config's architecture)",
                         description="Pretrain a model from a YAML config (sections device, model, training, data, "
                                     "in the CPU training guide's key names). Positional items: an optional "
                                     "CONFIG.yaml and dotted overrides such as training.learning_rate=1e-3.")
    pre.add_argument("items", nargs="*", metavar="CONFIG.yaml|key=value")
    pre.add_argument("--config", dest="config_file", default=None, metavar="CONFIG.yaml",
                     help="the config (as the CPU training guide's scripts/train.py --config); same as the positional")
    for flags, key, help_text in PRETRAIN_OPTIONS:
        pre.add_argument(*flags, dest=key, default=argparse.SUPPRESS, help=help_text, metavar="V")
    for flag, key, value, help_text in (("--overwrite", "training.overwrite", True, "replace an earlier run"),
                                        ("--no-progress", "training.progress", False, "no progress bar (logs only)")):
        pre.add_argument(flag, dest=key, action="store_const", const=value, default=argparse.SUPPRESS, help=help_text)
    _add_debug(pre)

    tu = sub.add_parser("tune", help="hyperparameter search (Optuna) over train or pretrain runs",
                        description="Search the options a space file names, one tunebench train|pretrain process "
                                    "per trial, judged by eval loss at an equal token budget. Positional items: an "
                                    "optional CONFIG.yaml and dotted overrides, as for the job. Rerunning the same "
                                    "command resumes the study.")
    tu.add_argument("items", nargs="*", metavar="CONFIG.yaml|key=value")
    tu.add_argument("--space", required=True,
                    help="YAML of options to search (key: [choices] or key: {low, high, log, step}), or a shipped "
                         "space's name (customer_support_lora)")
    tu.add_argument("--trials", type=int, default=10, help="trials the study should hold (default 10)")
    tu.add_argument("--job", dest="job_kind", default="train", choices=["train", "pretrain"],
                    help="what a trial runs (default train)")
    tu.add_argument("--sampler", default="tpe", choices=["tpe", "random"], help="Optuna sampler (default tpe)")
    tu.add_argument("--pruner", default="auto", choices=["auto", "median", "none"],
                    help="median: stop trials whose eval loss is worse than the median of earlier trials at the same "
                         "point; auto (default): median for --objective eval_loss, none for a task metric")
    tu.add_argument("--objective", default="eval_loss", choices=["eval_loss", "rougeL", "chrf", "exact_match"],
                    help="what a trial is judged by: eval_loss (default, minimized) or a task metric of its answers "
                         "to held-out rows (maximized; train.eval_generate rows, default 16)")
    length = tu.add_mutually_exclusive_group()
    length.add_argument("--budget-tokens", type=int, default=None,
                        help="every trial trains on about this many real tokens, whatever its batch size")
    length.add_argument("--max-steps", type=int, default=None, help="every trial runs this many optimizer steps")
    tu.add_argument("-o", "--output-dir", default="runs/tune",
                    help="study database, trials, results.csv, best.yaml, report/ (default runs/tune)")
    tu.add_argument("--storage", default=None,
                    help="Optuna storage URL shared by several machines, e.g. postgresql://user:pw@host/db "
                         "(default: $TUNEBENCH_STORAGE, which keeps the password out of `ps`; else sqlite in the "
                         "output directory). Printed with the password hidden")
    tu.add_argument("--study-name", default="tunebench", help="the study's name in the storage (default tunebench)")
    tu.add_argument("--device", default=None, choices=["cpu", "cuda", "mps"], help="device of every trial")
    tu.add_argument("--seed", type=int, default=42, help="the sampler's seed (default 42)")
    _add_debug(tu)

    sv = sub.add_parser("serve", help="web app: chat with models and runs, compare two blind (A/B)",
                        description="A Gradio app (the web extra): a chat tab, a blind A/B tab whose votes go to an "
                                    "SQLite file, and the A/B results. Offline; models load once, on first use.")
    sv.add_argument("--model", action="append", default=[], help="a base model spec or model directory (repeatable; "
                                                                   "default: SmolLM2 when nothing else is given)")
    sv.add_argument("--adapter", action="append", default=[], help="a training run directory (repeatable)")
    sv.add_argument("--port", type=int, default=7860)
    sv.add_argument("--host", default="127.0.0.1",
                    help="0.0.0.0 to be reached from other machines (then --auth, or --no-auth on purpose)")
    sv.add_argument("--ab-db", default="tunebench-ab.sqlite", help="A/B votes database (default ./tunebench-ab.sqlite)")
    sv.add_argument("--prompts", default=None, help="a prompt set (JSONL or CSV) for the A/B tab")
    sv.add_argument("--allow-download", action="store_true", help="let transformers fetch an uncached hub model")
    sv.add_argument("--auth", default=None, metavar="USER:PASS",
                    help="a login for the page (default: $TUNEBENCH_AUTH, which keeps the password out of `ps`); "
                         "required with a --host other machines can reach")
    sv.add_argument("--no-auth", action="store_true", help="serve a non-loopback --host without a login, on purpose")
    _placement_options(sv)
    _add_debug(sv)

    ab = sub.add_parser("ab-report", help="win rates of the A/B votes that tunebench serve stored")
    ab.add_argument("path", nargs="?", default="tunebench-ab.sqlite", help="the --ab-db of tunebench serve")
    _add_debug(ab)

    la = sub.add_parser("launch", help="run train or pretrain on several processes / machines (torchrun)",
                        description="A thin wrapper over torchrun (torch.distributed.run): tunebench launch "
                                    "--nproc-per-node 2 -- train [options]. Each rank gets the usable cores divided "
                                    "by the ranks on its machine as threads (unless OMP_NUM_THREADS is set).")
    la.add_argument("--nproc-per-node", type=int, required=True, help="processes on this machine")
    la.add_argument("--nnodes", type=int, default=1, help="machines taking part (default 1)")
    la.add_argument("--node-rank", type=int, default=0, help="this machine's place among them (default 0)")
    la.add_argument("--rdzv-endpoint", default=None,
                    help="HOST:PORT of the first machine, the same on every machine (c10d rendezvous); "
                         "default: one machine, a free local port")
    la.add_argument("--rdzv-id", default="tunebench", help="a name for this run, the same on every machine")
    la.add_argument("job_args", nargs=argparse.REMAINDER, metavar="-- train|pretrain ...")
    _add_debug(la)

    tk = sub.add_parser("tokenizer", help="train a tokenizer on your corpus (Hugging Face tokenizers)")
    tk_sub = tk.add_subparsers(dest="action", parser_class=_Parser, metavar="ACTION", required=True)
    tt = tk_sub.add_parser("train", help="train and save a tokenizer directory (AutoTokenizer loads it)")
    tt.add_argument("--data", nargs="+", required=True, help="text, JSONL, JSON, CSV or Parquet files, or directories")
    tt.add_argument("--vocab-size", type=int, required=True, help="vocabulary size to reach")
    tt.add_argument("--type", default="bpe", choices=["bpe", "unigram", "wordpiece", "char"],
                    help="bpe (byte-level, default) | unigram | wordpiece | char")
    tt.add_argument("-o", "--output-dir", required=True, help="where the tokenizer is saved")
    tt.add_argument("--text-column", default="text", help="column of JSONL/CSV/Parquet records (default text)")
    _add_debug(tt)

    for name, help_text in (("generate", "complete one prompt"), ("chat", "talk to a model in the terminal")):
        p = sub.add_parser(name, help=help_text)
        _model_options(p)
        if name == "generate":
            p.add_argument("--prompt", required=True, help="the user message")
            p.add_argument("--raw", action="store_true", help="no chat template or prompt format")
        p.add_argument("--template", default=None,
                       help="prompt format, as train's --template (default: the one the run trained with)")
        p.add_argument("--max-new-tokens", type=int, default=128)
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        _placement_options(p)
        _add_debug(p)

    p = sub.add_parser("merge", help="merge an adapter into its base model, or combine several LoRA adapters into one")
    _adapters_options(p, "give several to combine them into one adapter")
    p.add_argument("--output-dir", required=True,
                   help="new directory for the merged model (one adapter) or the combined adapter (several)")
    p.add_argument("--weights", default=None, help="several adapters: comma-separated weights (default equal, 1/n)")
    p.add_argument("--combination", default="linear",
                   help="several adapters: linear (default) | cat | ties | dare_ties | magnitude_prune (PEFT's)")
    p.add_argument("--density", type=float, default=None,
                   help="ties, dare_ties, magnitude_prune: the share of each adapter's weights kept (0-1)")
    p.add_argument("--eval-data", action="append", default=None,
                   help="several adapters: each one's task data, in --adapter order; prints each task's metric "
                        "from its own adapter and from the combined one")
    p.add_argument("--eval-rows", type=int, default=16, help="rows of each --eval-data answered (default 16)")
    _add_debug(p)

    p = sub.add_parser("prepare", help="a dataset -> seeded train/held-out JSONL files, with a summary (the study's "
                                       "prepare_custom_dataset.py)")
    p.add_argument("--data", default=None, help="a local CSV, JSON, JSONL, Parquet or saved datasets directory")
    p.add_argument("--dataset_name", "--dataset-name", default=None, help="a dataset already in the Hugging Face cache")
    p.add_argument("--split", default="train", help="its split (default train)")
    p.add_argument("--max_samples", "--max-samples", type=int, default=None, help="a seeded sample of this many rows")
    p.add_argument("--output_dir", "--output-dir", "-o", required=True, help="a new directory for the files")
    p.add_argument("--eval-fraction", "--eval_fraction", type=float, default=0.1, help="share held out (default 0.1)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--model", default=None, help="whose tokenizer counts the tokens (default SmolLM2)")
    p.add_argument("--max-length", "--max_length", type=int, default=128, help="the training --max-length to check")
    p.add_argument("--instruction-column", default=None, help="prompt column of instruction data")
    p.add_argument("--response-column", default=None, help="answer column of instruction data")
    p.add_argument("--template", default=None, help="the prompt format training will use (for the token counts)")
    _add_debug(p)

    p = sub.add_parser("export", help="a run's model, adapter merged, as GGUF (llama.cpp), Ollama or a HF directory")
    p.add_argument("run_dir", help="a training or pretraining run's --output-dir")
    p.add_argument("--format", default="gguf", help="gguf (default) | ollama (GGUF + Modelfile) | hf (merged directory)")
    p.add_argument("--quant", default=None,
                   help="gguf/ollama: f32 | f16 (default) | bf16 | q8_0 | q5_1 | q5_0 | q4_1 | q4_0; hf: f32 (default) | f16 | bf16")
    p.add_argument("-o", "--output", default=None,
                   help="the file (gguf) or new directory (ollama, hf); default RUN_DIR/export/...")
    p.add_argument("--allow-download", action="store_true", help="let the base model come from the hub")
    _add_debug(p)

    p = sub.add_parser("eval", help="loss and perplexity on a dataset; --generate N: answers scored (ROUGE-L, chrF, ...)")
    _adapters_options(p, "give several to compare them on the same rows")
    p.add_argument("--base", action="store_true", help="also evaluate the adapters' base model, for a base vs tuned table")
    p.add_argument("--generate", type=int, default=0,
                   help="answer N held-out rows (greedy, the run's prompt format) and score them")
    p.add_argument("--max-new-tokens", type=int, default=128, help="the cap on each answer (default 128)")
    p.add_argument("--output-dir", default="eval-results",
                   help="where the answers (answers-MODEL.jsonl) and scores.json go (default eval-results)")
    p.add_argument("--lm-eval", default=None, metavar="TASKS",
                   help="run lm-evaluation-harness tasks (comma-separated) on the merged model instead; "
                        "gsm8k_local reads --data, a GSM8K-style JSONL (pip install 'tunebench[lm-eval]')")
    p.add_argument("--lm-eval-limit", type=int, default=None, help="documents per task (default all)")
    p.add_argument("--lm-eval-include", default=None, help="a directory of your own lm-eval task YAMLs")
    p.add_argument("--data", default=None, help="dataset (default: the built-in sample)")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="auto (default: a GPU when present) | cpu | cuda | mps")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto (default: what training would pick on this device) | fp32 | bf16 | fp16")
    _add_debug(p)

    p = sub.add_parser("compare", help="run a matrix of experiments on the devices present; results CSV + report",
                       description="Runs each experiment as its own `tunebench train` process, appends one CSV "
                                   "row per run, resumes by skipping rows already written, then writes the report.")
    p.add_argument("--matrix", default="quick",
                   help="quick (default: the study's CPU configs + auto on the built-in data), study, or a YAML file")
    p.add_argument("--output", default="runs/compare/results.csv", help="results CSV (appended to; resumable)")
    p.add_argument("--runs-dir", default=None, help="where each run's directory goes (default: beside --output)")
    p.add_argument("--report-dir", default=None, help="where the report goes (default: beside --output)")
    p.add_argument("--repeats", type=int, default=1, help="runs per experiment; the report uses medians")
    p.add_argument("--device", action="append", choices=["cpu", "cuda", "mps"], help="limit to these devices")
    p.add_argument("--model", default=None, help="model for every experiment (default: the matrix's, else SmolLM2)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for every experiment (the gpt2-124m preset's, say, where SmolLM2's is absent)")
    p.add_argument("--data", default=None, help="dataset for every experiment")
    p.add_argument("--max-samples", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--retry-failed", action="store_true", help="rerun experiments whose row is oom/error")
    p.add_argument("--nproc", default=None, metavar="N[,M...]",
                   help="run every experiment on each of these numbers of processes (tunebench launch), e.g. 1,2")
    _add_debug(p)

    p = sub.add_parser("report", help="combine results CSVs into report.html and report.md")
    p.add_argument("results", nargs="*", help="results CSVs (from any machines)")
    p.add_argument("--results_csv", "--results-csv", dest="results_csv", action="append", default=[],
                   help="a results CSV (the study's generate_comparison_report.py spelling); repeatable")
    p.add_argument("-o", "--output-dir", "--output_dir", default=None,
                   help="where report.html/.md go (default runs/report; for a run directory, RUN_DIR/report)")
    p.add_argument("--baseline-device", default=None, help="device name speedups are measured against (default: slowest)")
    p.add_argument("--baseline-config", default=None, help="configuration speedups are measured against (default: first)")
    _add_debug(p)

    p = sub.add_parser("bench-data", help="measure the input pipeline alone (tokenize, cache, batches/s)")
    p.add_argument("--model", default=None, help="whose tokenizer (default SmolLM2)")
    p.add_argument("--data", default=None, help="dataset (default: the built-in sample)")
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=4)
    _add_debug(p)

    p = sub.add_parser("hw", help="this machine's hardware and the settings tunebench would pick")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--text", nargs="?", const="system_info.txt", default=None, metavar="FILE",
                   help="write the study's system_info.txt (date, CPU, GPU, CUDA, versions; default that name)")
    _add_debug(p)
    return parser


def _placement_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="auto (default: a GPU when present) | cpu | cuda | mps")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto (default: what training would pick on this device) | fp32 | bf16 | fp16")


def _adapters_options(p: argparse.ArgumentParser, several: str) -> None:
    """--model, --adapter (repeatable: what several of them do is `several`) and --allow-download."""
    p.add_argument("--model", default=None, help="base model (default: the adapter's base, else SmolLM2)")
    p.add_argument("--adapter", action="append", default=None, help=f"a training --output-dir; {several}")
    p.add_argument("--allow-download", action="store_true", help="let transformers fetch an uncached hub model")


def _model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="base model (default: the adapter's base, else SmolLM2)")
    p.add_argument("--adapter", default=None, help="a training --output-dir holding a LoRA adapter")
    p.add_argument("--allow-download", action="store_true", help="let transformers fetch an uncached hub model")


def train_config(args: argparse.Namespace):
    from tunebench.config import load_config

    options: dict[str, Any] = {k: v for k, v in vars(args).items() if "." in k}
    if isinstance(options.get("data.path"), list):
        from tunebench.config import parse_source

        given = options.pop("data.path")
        if len(given) == 1 and parse_source(given[0])[1] is None:
            options["data.path"] = given[0]
        else:
            options["data.sources"] = given
    configs, overrides = _items(args)
    profile = getattr(args, "profile", None)
    hydra = [o for o in overrides if o.startswith("hardware=")]  # the guide's Hydra-style `hardware=gpu_4090`
    if hydra:
        if profile is not None or len(hydra) > 1:
            raise TunebenchError("give the hardware profile once (--profile NAME or hardware=NAME)")
        profile = hydra[0].split("=", 1)[1]
        overrides = [o for o in overrides if o not in hydra]
    return load_config(configs[0] if configs else None, options, overrides, profile)


OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def _items(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(config files, dotted overrides) among a job's positional items; one config file at most."""
    items = getattr(args, "items", [])
    overrides = [i for i in items if OVERRIDE.match(i)]  # key=value; a path may hold '=' (runs/compile=on/...)
    configs = [i for i in items if i not in overrides]
    if len(configs) > 1:
        raise TunebenchError(f"one config file at most, got {', '.join(configs)}")
    return configs, overrides


def run_job(args: argparse.Namespace) -> int:
    if args.job == "train":
        from tunebench.jobs import finetune

        finetune.run(train_config(args))
    elif args.job == "pretrain":
        from tunebench import pretrain_config
        from tunebench.jobs import pretrain

        configs, overrides = _items(args)
        if args.config_file:
            if configs:
                raise TunebenchError(f"two configs given ({args.config_file} with --config, and {configs[0]}); give one")
            configs = [args.config_file]
        options = {k: v for k, v in vars(args).items() if "." in k}
        pretrain.run(pretrain_config.load(configs[0] if configs else None, options, overrides))
    elif args.job == "tune":
        from tunebench.config import parse_override
        from tunebench.jobs import search

        configs, overrides = _items(args)
        search.run(args.job_kind, configs[0] if configs else None,
                   dict(parse_override(o) for o in overrides), args.space, args.trials, args.output_dir,
                   args.sampler, args.pruner, args.budget_tokens, args.max_steps,
                   args.storage or os.environ.get("TUNEBENCH_STORAGE") or None, args.study_name,
                   args.device, args.seed, args.objective)
    elif args.job == "serve":
        from tunebench.models import SMOLLM2
        from tunebench.web import app

        app.serve(args.model or ([] if args.adapter else [SMOLLM2]), args.adapter, args.host, args.port, args.ab_db,
                  args.prompts, args.allow_download, auth=args.auth or os.environ.get("TUNEBENCH_AUTH") or None,
                  no_auth=args.no_auth, device=args.device, precision=args.precision)
    elif args.job == "ab-report":
        from tunebench.web import store

        print(store.report(args.path))
    elif args.job == "launch":
        from tunebench.jobs import launch

        return launch.run(args.job_args, args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint,
                          args.rdzv_id)
    elif args.job == "tokenizer":
        from tunebench.jobs import tokenizer

        tokenizer.train(args.data, args.vocab_size, args.type, args.output_dir, args.text_column)
    elif args.job == "generate":
        from tunebench.jobs.generate import generate

        print(generate(args.model, args.adapter, args.prompt, args.max_new_tokens, args.temperature, args.raw,
                       allow_download=args.allow_download, template=args.template, device=args.device,
                       precision=args.precision))
    elif args.job == "chat":
        from tunebench.jobs.generate import chat

        chat(args.model, args.adapter, args.max_new_tokens, args.temperature, allow_download=args.allow_download,
             template=args.template, device=args.device, precision=args.precision)
    elif args.job == "merge":
        from tunebench.jobs.merge import merge

        adapters = args.adapter or _need("--adapter")
        if len(adapters) == 1:
            merge(adapters[0], args.output_dir, args.model, args.allow_download)
        else:
            from tunebench.jobs.merge import combine

            from tunebench.jobs.merge import before_and_after

            if args.eval_data and len(args.eval_data) != len(adapters):
                raise TunebenchError(f"--eval-data gives {len(args.eval_data)} dataset(s) for {len(adapters)} adapters; "
                                     "give one per adapter, in the same order")
            if args.eval_rows < 1:
                raise TunebenchError(f"--eval-rows must be 1 or more, got {args.eval_rows}")
            if args.eval_data:  # refused now if unreadable, not after the combination
                from tunebench.data import formats

                for path in args.eval_data:
                    formats.load_examples(_data_config(path, None))
            out = combine(adapters, args.output_dir, _weights(args.weights), args.combination, args.density,
                          args.model, args.allow_download)
            if args.eval_data:
                print(before_and_after(adapters, out, args.eval_data, args.eval_rows))
    elif args.job == "prepare":
        from tunebench.jobs.prepare import prepare

        options = {k: v for k, v in {"data.instruction_column": args.instruction_column,
                                     "data.response_column": args.response_column,
                                     "data.template": args.template}.items() if v is not None}
        prepare(args.output_dir, args.data, args.dataset_name, args.max_samples, args.eval_fraction, args.seed,
                args.model, args.max_length, args.split, options)
    elif args.job == "export":
        from tunebench.jobs.export import export

        export(args.run_dir, args.format, args.quant, args.output, args.allow_download)
    elif args.job == "eval":
        from tunebench.jobs import evaluate

        from pathlib import Path

        from tunebench.inference import base_of
        from tunebench.jsonfile import write_json

        data = _data_config(args.data, args.max_length, args.max_samples)
        adapters = args.adapter or [None]
        if args.base and adapters == [None]:
            raise TunebenchError("--base compares a base model with its adapters; give --adapter too")
        chosen = [("base", args.model or base_of(adapters[0]), None)] if args.base else []
        chosen += [(evaluate.label_of(args.model, a), args.model, a) for a in adapters]
        labels = [label if [c[0] for c in chosen].count(label) == 1 else f"{label}-{i + 1}"
                  for i, (label, _, _) in enumerate(chosen)]
        out = Path(args.output_dir)
        if args.lm_eval:
            for label, (_, model, adapter) in zip(labels, chosen):
                result = evaluate.lm_eval(model, adapter, args.lm_eval, args.data, args.lm_eval_limit,
                                          args.lm_eval_include, args.batch_size, args.device, args.precision,
                                          args.allow_download, out / label)
                print(json.dumps({"label": label, **result}, indent=2))
            return 0
        results = [(label, evaluate.run(
            model, adapter, data, args.batch_size, allow_download=args.allow_download, device=args.device,
            precision=args.precision, generate=args.generate, max_new_tokens=args.max_new_tokens,
            answers=out / f"answers-{label}.jsonl", split_of=adapters[0]))
            for label, (_, model, adapter) in zip(labels, chosen)]
        if args.generate:
            write_json(out / "scores.json", {label: r for label, r in results})
        if len(results) == 1:
            print(json.dumps(results[0][1], indent=2))
        else:
            print(evaluate.side_by_side(results))
        if args.generate:
            print(f"answers and scores in {out}/ (answers-MODEL.jsonl, scores.json); generated for "
                  f"{results[0][1]['generated_from']}")
    elif args.job == "compare":
        from pathlib import Path

        from tunebench.jobs import compare, report

        if args.repeats < 1:
            raise TunebenchError(f"--repeats must be 1 or more, got {args.repeats}")
        extra = {k: v for k, v in {"model.name": args.model, "model.tokenizer": args.tokenizer, "data.path": args.data,
                                   "data.max_samples": args.max_samples, "train.max_steps": args.max_steps}.items()
                 if v is not None}
        out = Path(args.output)
        nproc = None
        if args.nproc:
            try:
                nproc = [int(n) for n in args.nproc.split(",")]
            except ValueError:
                nproc = [0]
            if min(nproc) < 1:
                raise TunebenchError(f"--nproc {args.nproc}: give numbers of processes, 1 or more, such as 1,2")
        results = compare.run(args.matrix, str(out), args.runs_dir or str(out.parent / "runs"), args.repeats, extra,
                              args.device, args.retry_failed, nproc)
        html = report.write([str(results)], args.report_dir or str(out.parent / "report"))
        print(f"report: {html.resolve()}")
    elif args.job == "report":
        from pathlib import Path

        from tunebench.jobs import report, run_report

        args.output_dir_given = args.output_dir is not None
        args.output_dir = args.output_dir or "runs/report"
        results = args.results + args.results_csv
        if not results:
            raise TunebenchError("report needs results: give CSVs (or --results_csv FILE), or a run directory")
        runs = [r for r in results if Path(r).is_dir()]
        if runs:  # the picture of each run: its own report, in RUN_DIR/report unless --output-dir says
            if len(runs) != len(results):
                raise TunebenchError("give results CSVs or run directories, not both")
            for r in runs:
                out = Path(args.output_dir) / Path(r).resolve().name if args.output_dir_given else None
                print(f"report: {run_report.write(r, out).resolve()}")
            return 0
        html = report.write(results, args.output_dir, args.baseline_device, args.baseline_config)
        print(f"report: {html.resolve()}")
    elif args.job == "bench-data":
        from tunebench.jobs import bench_data

        bench_data.run(args.model, _data_config(args.data, args.max_length), args.batch_size)
    elif args.job == "hw":
        from tunebench.jobs import hw

        hw.run(as_json=args.json, text=args.text)
    return 0


def _data_config(path: str | None, max_length: int | None, max_samples: int | None = None):
    """The data section, built and checked exactly as `train` builds it."""
    from tunebench.config import load_config

    options = {"data.path": path, "data.max_length": max_length, "data.max_samples": max_samples}
    return load_config(options={k: v for k, v in options.items() if v is not None}).data


def _weights(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise TunebenchError(f"--weights must be comma-separated numbers such as 0.6,0.4, got {text!r}") from None
    if not all(math.isfinite(w) for w in weights):
        raise TunebenchError(f"--weights must be finite numbers, got {text!r}")
    return weights


def _need(flag: str):
    raise TunebenchError(f"{flag} is required for this job")


def _leave_process_group() -> None:
    """A rank leaving on an error still closes its process group: exiting with gloo's connections open
    aborts the process (SIGABRT) when its peer has closed its side first."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _quiet_libraries(allow_download: bool) -> None:
    """Offline unless asked, and no library chatter that a user cannot act on."""
    import logging
    import warnings

    if not allow_download:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Writing model shards" bars on every save
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # advice about padding masks and lengths we already handle


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    _quiet_libraries("--allow-download" in argv)
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        unknown = [e for e in extra if e.startswith("-") or getattr(args, "job", None) not in ("train", "pretrain", "tune")]
        if unknown:
            raise TunebenchError(f"unrecognized argument(s): {' '.join(unknown)}; see `tunebench {args.job or ''} --help`")
        if extra:
            args.items = list(getattr(args, "items", [])) + extra
        if args.job is None:
            parser.print_help()
            return 2
        try:
            return run_job(args)
        finally:
            _leave_process_group()
    except TunebenchError as e:
        if debug:
            raise
        rank = os.environ.get("RANK", "0") if "WORLD_SIZE" in os.environ else "0"
        if not getattr(e, "echo", False):  # one console for all ranks: rank 0's refusals are said once
            print(f"tunebench: error: {'' if rank == '0' else f'[rank {rank}] '}{e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        print("tunebench: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # anything unforeseen: still one line, the traceback behind --debug
        if debug:
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"tunebench: error: {type(e).__name__}: {first} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
