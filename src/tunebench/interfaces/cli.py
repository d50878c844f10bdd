"""The `tunebench` command: options -> config -> job. Problems become one-line errors."""

from __future__ import annotations

import argparse
import math
import os
import sys

from tunebench.core import startup
from tunebench.core.errors import TunebenchError
from tunebench.interfaces.cli_parser import build_parser, train_config
from tunebench.interfaces.cli_parser import items as _items


def _train(args: argparse.Namespace) -> int | None:
    cfg = train_config(args)  # checked before the jobs load torch, transformers and peft (7-9 s of start-up)
    from tunebench.jobs import finetune, grpo

    (grpo if cfg.objective.samples else finetune).run(cfg)


def _pretrain_config(args: argparse.Namespace, world_size: int | None = None):
    from tunebench.settings import pretrain as pretrain_config

    configs, overrides = _items(args)
    if args.config_file:
        if configs:
            raise TunebenchError(f"two configs given ({args.config_file} with --config, and {configs[0]}); give one")
        configs = [args.config_file]
    options = {k: v for k, v in vars(args).items() if "." in k}
    return pretrain_config.load(configs[0] if configs else None, options, overrides, world_size=world_size)


def _pretrain(args: argparse.Namespace) -> int | None:
    # The settings are checked first: a refused one is said in about a second, where the libraries the job loads
    # (torch, transformers, peft) take 7-9 s of a 2-core machine's start-up before a word of it.
    cfg = _pretrain_config(args)
    from tunebench.jobs import pretrain

    pretrain.run(cfg)


def _tune(args: argparse.Namespace) -> int | None:
    from tunebench.jobs import search
    from tunebench.settings.finetune import parse_override

    configs, overrides = _items(args)
    search.run(search.Search(
        args.job_kind, configs[0] if configs else None, dict(parse_override(o) for o in overrides), args.space,
        args.trials, args.output_dir, args.sampler, args.pruner, args.budget_tokens, args.max_steps,
        args.storage or os.environ.get("TUNEBENCH_STORAGE") or None, args.study_name, args.device, args.seed,
        args.objective))


def _serve(args: argparse.Namespace) -> int | None:
    from tunebench.interfaces.web import app
    from tunebench.model.models import SMOLLM2

    app.serve(app.Served(args.model or ([] if args.adapter or args.gguf else [SMOLLM2]), args.adapter, args.gguf,
                         args.runtime, args.device, args.precision, args.allow_download),
              app.Door(args.host, args.port, args.auth or os.environ.get("TUNEBENCH_AUTH") or None, args.no_auth,
                       args.api_key or os.environ.get("TUNEBENCH_API_KEY") or None, args.allowed_host),
              ab_db=args.ab_db, prompts=args.prompts, runs_dir=None if args.no_studio else args.runs_dir or "runs",
              runs_dir_asked=args.runs_dir is not None, studio_models=args.studio_model)

def new_file(path: str, flag: str) -> None:
    """A file a command writes is a new one: an existing file (the A/B store itself, say) is never replaced."""
    if os.path.lexists(path):
        raise TunebenchError(f"{flag} {path} already exists; give a new file name (or delete that file first)")


def _ab_report(args: argparse.Namespace) -> int | None:
    from tunebench.data import votes

    if args.export_pairs:
        new_file(args.export_pairs, "--export-pairs")
    print(votes.report(args.path))
    if args.export_pairs:
        from tunebench.data import pairs

        found = pairs.from_store(args.path)
        pairs.export(found, args.export_pairs)
        print(f"{args.export_pairs}: {found.describe()}")


def _launch(args: argparse.Namespace) -> int | None:
    from tunebench.jobs import launch

    return launch.run(args.job_args, args.nproc_per_node, args.nnodes, args.node_rank, args.rdzv_endpoint,
                      args.rdzv_id, check=_check_launched)


def _check_launched(job_args: list[str], world_size: int) -> None:
    """The launched job's settings, checked here at the world size its ranks will have, before torchrun starts
    one: a refused setting is one line from the launcher, not a line from rank 0 after every rank has loaded
    its libraries (each rank checks again, as a job run by torchrun itself does)."""
    job = parse(job_args)
    if job.job == "train":
        train_config(job, world_size)
    else:
        _pretrain_config(job, world_size)


def _tokenizer(args: argparse.Namespace) -> int | None:
    from tunebench.data import tokenizer_training as tokenizer

    tokenizer.train(args.data, args.vocab_size, args.type, args.output_dir, args.text_column,
                    overwrite=args.overwrite)


def _generate(args: argparse.Namespace) -> int | None:
    from tunebench.jobs.generate import generate

    print(generate(args.model, args.adapter, args.prompt, args.max_new_tokens, args.temperature, args.raw,
                   allow_download=args.allow_download, template=args.template, device=args.device,
                   precision=args.precision))


def _chat(args: argparse.Namespace) -> int | None:
    from tunebench.jobs.generate import chat

    chat(args.model, args.adapter, args.max_new_tokens, args.temperature, allow_download=args.allow_download,
         template=args.template, device=args.device, precision=args.precision)


def _merge(args: argparse.Namespace) -> int | None:
    from tunebench.jobs import merge

    merge.run(args.adapter or _need("--adapter"), args.output_dir, args.model, args.allow_download,
              _weights(args.weights), args.combination, args.density, args.eval_data, args.eval_rows)


def _prepare(args: argparse.Namespace) -> int | None:
    from tunebench.jobs.prepare import prepare

    options = {k: v for k, v in {"data.instruction_column": args.instruction_column,
                                 "data.response_column": args.response_column,
                                 "data.template": args.template}.items() if v is not None}
    prepare(args.output_dir, args.data, args.dataset_name, args.max_samples, args.eval_fraction, args.seed,
            args.model, args.max_length, args.split, options)


def _export(args: argparse.Namespace) -> int | None:
    from tunebench.jobs import quant_auto
    from tunebench.jobs.export import export

    export(args.run_dir, args.format, args.quant, args.output, args.allow_download,
           quant_auto.Settings(args.quant_rows, args.quant_tolerance, args.quant_metric, args.max_new_tokens,
                               args.quant_types))


def _eval(args: argparse.Namespace) -> int | None:
    from tunebench.jobs import eval_preference, eval_rewarded, evaluate

    run_dir = (args.adapter or [None])[0] or args.model
    rewarded = None if args.lm_eval else eval_rewarded.rewarded_run(run_dir)
    if rewarded is not None:  # a GRPO or RFT run: judged by its own rewards on its held-out prompts
        if args.generate or args.gguf or len(args.adapter or []) > 1:
            raise TunebenchError(f"'{run_dir}' learned from rewards ({rewarded.objective.name}): eval answers its "
                                 "held-out prompts and scores them with its own rewards; drop --generate, --gguf and "
                                 "other --adapter runs (eval them apart)")
        return eval_rewarded.table(run_dir, rewarded, args.base, args.data, args.device, args.precision,
                                   args.output_dir)
    preferred = None if args.lm_eval or args.generate or args.gguf else eval_preference.preference_run(run_dir)
    if preferred is not None:  # a DPO, ORPO or KTO run: its own objective over its held-out pairs
        if len(args.adapter or []) > 1:
            raise TunebenchError(f"'{run_dir}' learned from preferences ({preferred.objective.name}): eval scores "
                                 "its held-out pairs with its own objective; eval other --adapter runs apart")
        return eval_preference.table(run_dir, preferred, args.base, args.data, args.device, args.precision,
                                     args.output_dir)
    evaluate.table(args.model, args.adapter or [None], args.base,
                   _data_config(args.data, args.max_length, args.max_samples), args.output_dir,
                   batch_size=args.batch_size,
                   where=evaluate.Placement(args.device, args.precision, args.allow_download),
                   generate=args.generate, max_new_tokens=args.max_new_tokens,
                   lm_eval_ask=evaluate.LmEvalAsk(args.lm_eval, args.data, args.lm_eval_limit, args.lm_eval_include)
                   if args.lm_eval else None, ggufs=args.gguf)


def _compare(args: argparse.Namespace) -> int | None:
    from tunebench.jobs import compare

    extra = {k: v for k, v in {"model.name": args.model, "model.tokenizer": args.tokenizer, "data.path": args.data,
                               "data.max_samples": args.max_samples, "schedule.max_steps": args.max_steps,
                               "logging.report_to": args.report_to, "logging.project": args.project}.items()
             if v is not None}
    compare.main(args.matrix, args.output, args.runs_dir, args.repeats, extra, args.device, args.retry_failed,
                 args.nproc, args.report_dir)


def _report(args: argparse.Namespace) -> int | None:
    from tunebench.jobs import run_report

    run_report.main(args.results + args.results_csv, args.output_dir, args.baseline_device, args.baseline_config)


def _bench_data(args: argparse.Namespace) -> int | None:
    from tunebench.jobs import bench_data

    bench_data.run(args.model, _data_config(args.data, args.max_length), args.batch_size)


def _hw(args: argparse.Namespace) -> int | None:
    from tunebench.jobs import hw

    if args.text:
        new_file(args.text, "--text")
    if args.record:
        new_file(args.record, "--record")
    hw.run(as_json=args.json, text=args.text, machine_record=args.machine, model=args.model, method=args.method,
           max_length=args.max_length, record_to=args.record, precision=args.precision)


JOBS = {  # job name -> what runs it; a job returns its exit code, or None for 0
    "train": _train,
    "pretrain": _pretrain,
    "tune": _tune,
    "serve": _serve,
    "ab-report": _ab_report,
    "launch": _launch,
    "tokenizer": _tokenizer,
    "generate": _generate,
    "chat": _chat,
    "merge": _merge,
    "prepare": _prepare,
    "export": _export,
    "eval": _eval,
    "compare": _compare,
    "report": _report,
    "bench-data": _bench_data,
    "hw": _hw,
}


def run_job(args: argparse.Namespace) -> int:
    if args.job not in ("train", "pretrain"):  # those resume collection when their loop starts (see startup)
        startup.done()
    return JOBS[args.job](args) or 0


def _data_config(path: str | None, max_length: int | None, max_samples: int | None = None):
    """The data section, built and checked exactly as `train` builds it."""
    from tunebench.settings.finetune import load_config

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
    # transformers 5.25 installs the kernels hub client, which warns "Skipping publisher trust check for
    # 'kernels-community/quantization-bitsandbytes' because Hugging Face Hub is in offline mode" as the model loads:
    # offline is tunebench's default and no kernel is fetched, so there is nothing for the user to act on
    logging.getLogger("kernels").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # "Writing model shards" bars on every save
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # advice about padding masks and lengths we already handle


def entry() -> int:
    """The `tunebench` command and `python -m tunebench`: main(), with the collector paused while the
    libraries load and freed memory kept for reuse (see startup)."""
    startup.keep_freed_memory()  # may start this command again, once, before anything is loaded
    startup.pause()
    code = main()
    startup.before_exit()
    return code


def parse(argv: list[str]):
    """The command line as main() reads it: argparse's, where a word left over is refused (an unknown flag, or
    any extra word but train's, pretrain's and tune's KEY=VALUE overrides, which join `items`)."""
    args, extra = build_parser().parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or getattr(args, "job", None) not in ("train", "pretrain", "tune")]
    if unknown:
        raise TunebenchError(f"unrecognized argument(s): {' '.join(unknown)}; see `tunebench {args.job or ''} --help`")
    if extra:
        args.items = list(getattr(args, "items", [])) + extra
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    _quiet_libraries("--allow-download" in argv)
    try:
        args = parse(argv)
        if args.job is None:
            build_parser().print_help()
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
