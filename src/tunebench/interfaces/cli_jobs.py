"""The options of every job but train and pretrain (whose options are the settings', cli_parser.py): a function a
job, each adding its subcommand to `tunebench`'s parser (cli_parser.build_parser), and the argument types and
option groups they share."""

from __future__ import annotations

import argparse

from tunebench.core.errors import TunebenchError
from tunebench.jobs import quant_auto
from tunebench.model import quality
from tunebench.settings.finetune import METHODS


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, like every other input error
        raise TunebenchError(f"{message}; see `{self.prog} --help`")


def positive(text: str) -> int:
    """argparse's type for a count that must be 1 or more (a bad one is refused before anything loads)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be 1 or more")
    return value


def port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number: pass one from 1 to 65535, e.g. 7860")
    return value


def add_debug(p: argparse.ArgumentParser) -> None:
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def add_tune(sub) -> None:
    """tune: an Optuna study over train or pretrain runs."""
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
    tu.add_argument("--objective", default="eval_loss",
                    choices=["eval_loss", *quality.TASK_OBJECTIVES, "reward_accuracy"],
                    help="what a trial is judged by: eval_loss (default, minimized), a task metric of its answers "
                         "to held-out rows (maximized; train.eval_generate rows, default 16; the tool_ scores "
                         "where the rows offer tools), or reward_accuracy on the held-out pairs of a DPO/ORPO run "
                         "(maximized)")
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
    add_debug(tu)


def add_serve(sub) -> None:
    """serve: the web app (chat, blind A/B, the studio's Train and Runs tabs) and its OpenAI-compatible API."""
    sv = sub.add_parser("serve", help="web app: chat with models and runs, compare two blind (A/B), train new runs",
                        description="A Gradio app (the web extra): a chat tab, a blind A/B tab whose votes go to an "
                                    "SQLite file, the A/B results, and the studio's Train and Runs tabs (runs in "
                                    "--runs-dir). Offline; models load once, on first use.")
    sv.add_argument("--model", action="append", default=[], help="a base model spec or model directory (repeatable; "
                                                                   "default: SmolLM2 when nothing else is given)")
    sv.add_argument("--adapter", action="append", default=[], help="a training run directory (repeatable)")
    sv.add_argument("--gguf", action="append", default=[], metavar="FILE.gguf",
                    help="an export of a run (inside RUN_DIR/export/), answered by llama.cpp (repeatable: A/B a "
                         "run's f16 against its q4_k_m, say)")
    sv.add_argument("--runtime", default="pytorch", choices=("pytorch", "llama.cpp"),
                    help="what answers the --adapter runs: pytorch (default), or llama.cpp (each run exported to "
                         "f16 GGUF once, kept in RUN_DIR/export/, and served from that file)")
    sv.add_argument("--port", type=port, default=7860, help="1 to 65535 (default 7860)")
    sv.add_argument("--host", default="127.0.0.1",
                    help="0.0.0.0 to be reached from other machines (then --auth, or --no-auth on purpose)")
    sv.add_argument("--ab-db", default="tunebench-ab.sqlite", help="A/B votes database (default ./tunebench-ab.sqlite)")
    sv.add_argument("--prompts", default=None, help="a prompt set (JSONL or CSV) for the A/B tab")
    sv.add_argument("--runs-dir", default=None, help="where the Train tab's runs go and the Runs tab looks "
                                                     "(default ./runs); the tabs need --auth, or --no-auth on purpose")
    sv.add_argument("--studio-model", action="append", default=[], metavar="DIR",
                    help="a model directory the Train tab may start runs from, besides the presets, the served bases "
                         "and the runs (repeatable)")
    sv.add_argument("--no-studio", action="store_true", help="serve chat and A/B only: no Train or Runs tab")
    sv.add_argument("--allow-download", action="store_true", help="let transformers fetch an uncached hub model")
    sv.add_argument("--auth", default=None, metavar="USER:PASS",
                    help="a login for the page (default: $TUNEBENCH_AUTH, which keeps the password out of `ps`); "
                         "required with a --host other machines can reach")
    sv.add_argument("--no-auth", action="store_true", help="serve without a login on purpose: a non-loopback --host, "
                                                            "or the Train and Runs tabs to every local user")
    sv.add_argument("--api-key", default=None, metavar="KEY",
                    help="the OpenAI-compatible API's own key, sent as 'Authorization: Bearer KEY' (default: "
                         "$TUNEBENCH_API_KEY); with a login and no key, the API is closed")
    sv.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                    help="a Host name a server without a login answers besides its own (repeatable; the others "
                         "are refused, which keeps DNS-rebinding pages out)")
    placement_options(sv)
    add_debug(sv)


def add_ab_report(sub) -> None:
    """ab-report: the A/B votes' win rates."""
    ab = sub.add_parser("ab-report", help="win rates of the A/B votes that tunebench serve stored")
    ab.add_argument("path", nargs="?", default="tunebench-ab.sqlite", help="the --ab-db of tunebench serve")
    ab.add_argument("--export-pairs", metavar="FILE.jsonl", default=None,
                    help="also write each A or B vote as a preference pair (prompt, chosen, rejected; ties and "
                         "both-bad skipped) for DPO/ORPO in tunebench or other tools")
    add_debug(ab)


def add_launch(sub) -> None:
    """launch: torchrun over train or pretrain."""
    la = sub.add_parser("launch", help="run train or pretrain on several processes / machines (torchrun)",
                        description="A thin wrapper over torchrun (torch.distributed.run): tunebench launch "
                                    "--nproc-per-node 2 -- train [options]. Each rank gets the usable cores divided "
                                    "by the ranks on its machine as threads (unless OMP_NUM_THREADS is set). Across "
                                    "machines: the rendezvous is unauthenticated and torchrun's rendezvous pickles its "
                                    "state in the store, so whoever reaches --rdzv-endpoint can run code in every "
                                    "launch process; use a network you trust.")
    la.add_argument("--nproc-per-node", type=int, required=True, help="processes on this machine")
    la.add_argument("--nnodes", type=int, default=1, help="machines taking part (default 1)")
    la.add_argument("--node-rank", type=int, default=0, help="this machine's place among them (default 0)")
    la.add_argument("--rdzv-endpoint", default=None,
                    help="HOST:PORT of the first machine, the same on every machine (c10d rendezvous); "
                         "default: one machine, a free local port")
    la.add_argument("--rdzv-id", default="tunebench", help="a name for this run, the same on every machine")
    la.add_argument("job_args", nargs=argparse.REMAINDER, metavar="-- train|pretrain ...")
    add_debug(la)


def add_tokenizer(sub) -> None:
    """tokenizer train."""
    tk = sub.add_parser("tokenizer", help="train a tokenizer on your corpus (Hugging Face tokenizers)")
    tk_sub = tk.add_subparsers(dest="action", parser_class=Parser, metavar="ACTION", required=True)
    tt = tk_sub.add_parser("train", help="train and save a tokenizer directory (AutoTokenizer loads it)")
    tt.add_argument("--data", nargs="+", required=True, help="text, JSONL, JSON, CSV or Parquet files, or directories")
    tt.add_argument("--vocab-size", type=int, required=True, help="vocabulary size to reach")
    tt.add_argument("--type", default="bpe", choices=["bpe", "unigram", "wordpiece", "char"],
                    help="bpe (byte-level, default) | unigram | wordpiece | char")
    tt.add_argument("-o", "--output-dir", required=True, help="where the tokenizer is saved")
    tt.add_argument("--text-column", default="text", help="column of JSONL/CSV/Parquet records (default text)")
    tt.add_argument("--overwrite", action="store_true", help="replace what --output-dir already holds")
    add_debug(tt)


def add_generate(sub) -> None:
    """generate and chat."""
    for name, help_text in (("generate", "complete one prompt"), ("chat", "talk to a model in the terminal")):
        p = sub.add_parser(name, help=help_text)
        model_options(p)
        if name == "generate":
            p.add_argument("--prompt", required=True, help="the user message")
            p.add_argument("--raw", action="store_true", help="no chat template or prompt format")
        p.add_argument("--template", default=None,
                       help="prompt format, as train's --template (default: the one the run trained with)")
        p.add_argument("--max-new-tokens", type=positive, default=128)
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
        placement_options(p)
        add_debug(p)


def add_merge(sub) -> None:
    """merge: an adapter into its base, or several adapters into one."""
    p = sub.add_parser("merge", help="merge an adapter into its base model, or combine several LoRA adapters into one")
    adapters_options(p, "give several to combine them into one adapter")
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
    add_debug(p)


def add_prepare(sub) -> None:
    """prepare: a dataset split into seeded train and held-out files."""
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
    add_debug(p)


def add_export(sub) -> None:
    """export: GGUF, Ollama or a merged HF directory, and --quant auto."""
    p = sub.add_parser("export", help="a run's model, adapter merged, as GGUF (llama.cpp), Ollama or a HF directory")
    p.add_argument("run_dir", help="a training or pretraining run's --output-dir")
    p.add_argument("--format", default="gguf", help="gguf (default) | ollama (GGUF + Modelfile) | hf (merged directory)")
    p.add_argument("--quant", default=None,
                   help="gguf/ollama: f32 | f16 (default) | bf16 | q8_0 | q6_k | q5_k_m | q5_k_s | q5_1 | q5_0 | q4_k_m | "
                        "q4_k_s | q4_1 | q4_0 | q3_k_m | q2_k, or auto: the smallest type whose task score in llama.cpp "
                        "is within --quant-tolerance of f16's (a new directory with the file and the table); "
                        "hf: f32 (default) | f16 | bf16")
    p.add_argument("--quant-rows", type=int, default=quant_auto.ROWS,
                   help=f"--quant auto: held-out rows each type answers (default {quant_auto.ROWS})")
    p.add_argument("--quant-tolerance", type=float, default=quant_auto.TOLERANCE,
                   help=f"--quant auto: points of the metric a type may lose against f16 (default {quant_auto.TOLERANCE:g})")
    p.add_argument("--quant-types", default=",".join(quant_auto.CANDIDATES), type=lambda s: tuple(s.split(",")),
                   help="--quant auto: the types to try, comma-separated (default every one, smallest bits first: "
                        f"{','.join(quant_auto.CANDIDATES)}); each is written and checked, so fewer take less time")
    p.add_argument("--quant-metric", default="rougeL", choices=quality.OBJECTIVES,
                   help="--quant auto: the task score compared (default rougeL)")
    p.add_argument("--max-new-tokens", type=positive, default=128,
                   help="--quant auto: the cap on each answer (default 128)")
    p.add_argument("-o", "--output", default=None,
                   help="the file (gguf) or new directory (ollama, hf, --quant auto); default RUN_DIR/export/...")
    p.add_argument("--allow-download", action="store_true", help="let the base model come from the hub")
    add_debug(p)


def add_eval(sub) -> None:
    """eval: loss, generated answers, lm-eval tasks, a rewarded or preference run judged as it trained."""
    p = sub.add_parser("eval", help="loss and perplexity on a dataset; --generate N: answers scored (ROUGE-L, chrF, "
                       "...); a GRPO or RFT run: its held-out prompts scored by its own rewards; a DPO, ORPO or KTO run: "
                       "its held-out pairs by its own objective (reward accuracy and margin)")
    adapters_options(p, "give several to compare them on the same rows")
    p.add_argument("--base", action="store_true", help="also evaluate the adapters' base model, for a base vs tuned table")
    p.add_argument("--generate", type=int, default=0,
                   help="answer N held-out rows (greedy, the run's prompt format) and score them")
    p.add_argument("--max-new-tokens", type=positive, default=128, help="the cap on each answer (default 128)")
    p.add_argument("--gguf", action="append", default=[], metavar="FILE.gguf",
                   help="an export of the run (--adapter RUN_DIR) answering the same rows in llama.cpp, a row of the "
                        "same table (with --generate N); give several to compare quant types")
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
    p.add_argument("--batch-size", type=positive, default=8)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="auto (default: a GPU when present) | cpu | cuda | mps")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto (default: what training would pick on this device) | fp32 | bf16 | fp16")
    add_debug(p)


def add_compare(sub) -> None:
    """compare: a matrix of runs, a CSV and a report."""
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
    p.add_argument("--report-to", "--report_to", nargs="+", default=None, metavar="TRACKER",
                   help="log every run to these trackers (tensorboard, mlflow, wandb, trackio), one experiment "
                        "(project) and group named after the output's folder")
    p.add_argument("--project", default=None, help="the trackers' experiment / project (default: the output's folder)")
    p.add_argument("--nproc", default=None, metavar="N[,M...]",
                   help="run every experiment on each of these numbers of processes (tunebench launch), e.g. 1,2")
    add_debug(p)


def add_report(sub) -> None:
    """report: results CSVs into one report."""
    p = sub.add_parser("report", help="combine results CSVs into report.html and report.md")
    p.add_argument("results", nargs="*", help="results CSVs (from any machines)")
    p.add_argument("--results_csv", "--results-csv", dest="results_csv", action="append", default=[],
                   help="a results CSV (the study's generate_comparison_report.py spelling); repeatable")
    p.add_argument("-o", "--output-dir", "--output_dir", default=None,
                   help="where report.html/.md go (default runs/report; for a run directory, RUN_DIR/report)")
    p.add_argument("--baseline-device", default=None, help="device name speedups are measured against (default: slowest)")
    p.add_argument("--baseline-config", default=None, help="configuration speedups are measured against (default: first)")
    add_debug(p)


def add_bench_data(sub) -> None:
    """bench-data: the input pipeline alone."""
    p = sub.add_parser("bench-data", help="measure the input pipeline alone (tokenize, cache, batches/s)")
    p.add_argument("--model", default=None, help="whose tokenizer (default SmolLM2)")
    p.add_argument("--data", default=None, help="dataset (default: the built-in sample)")
    p.add_argument("--max-length", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=4)
    add_debug(p)


def add_hw(sub) -> None:
    """hw: the hardware and the settings tunebench would pick."""
    p = sub.add_parser("hw", help="this machine's hardware and the settings tunebench would pick")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--text", nargs="?", const="system_info.txt", default=None, metavar="FILE",
                   help="write the study's system_info.txt (date, CPU, GPU, CUDA, versions; default that name)")
    p.add_argument("--machine", default=None, metavar="RECORD",
                   help="the settings tunebench would pick on another machine, from the record `tunebench hw --json` "
                        "wrote there")
    p.add_argument("--model", default=None, help="also plan the memory training this model would take, from its "
                                                 "config alone: a model directory, a cached hub id or a config.json")
    p.add_argument("--method", default="lora", choices=METHODS, help="the method that memory plan is for (default lora)")
    p.add_argument("--max-length", type=int, default=128, help="the rows' tokens that memory plan is for (default 128)")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="write what this machine measured (the measurement cache's complete probes) as a machine "
                        "class record, the format tunebench ships in configs/machines/")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="the precision --record writes (default: what training would pick here)")
    add_debug(p)


def placement_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                   help="auto (default: a GPU when present) | cpu | cuda | mps")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="auto (default: what training would pick on this device) | fp32 | bf16 | fp16")


def adapters_options(p: argparse.ArgumentParser, several: str) -> None:
    """--model, --adapter (repeatable: what several of them do is `several`) and --allow-download."""
    p.add_argument("--model", default=None, help="base model (default: the adapter's base, else SmolLM2)")
    p.add_argument("--adapter", action="append", default=None, help=f"a training --output-dir; {several}")
    p.add_argument("--allow-download", action="store_true", help="let transformers fetch an uncached hub model")


def model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="base model (default: the adapter's base, else SmolLM2)")
    p.add_argument("--adapter", default=None, help="a training --output-dir holding a LoRA adapter")
    p.add_argument("--allow-download", action="store_true", help="let transformers fetch an uncached hub model")
