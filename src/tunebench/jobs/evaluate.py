"""`tunebench eval`: token-weighted loss and perplexity of a model (with an optional adapter) on a dataset,
and with `--generate N` the task itself: answers generated for N held-out rows in the run's prompt format,
scored (tunebench.model.quality). Several models (`--base`, `--adapter A --adapter B`) give one table, on the
same rows. Runs on the device and in the precision a training run would pick (or those asked for)."""

from __future__ import annotations

import importlib.util
import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import write_json
from tunebench.data import batching, formats
from tunebench.data.tokenize import load_tokenized, split
from tunebench.jobs.generate import trained_template
from tunebench.jobs.parts import runner
from tunebench.machine import hardware
from tunebench.model import inference, llama_cpp_tools, models, quality
from tunebench.model.inference import trained_on
from tunebench.settings.finetune import DataConfig
from tunebench.settings.rundir import RunDir
from tunebench.training.objective import CausalLMLoss, evaluate


@dataclass(frozen=True)
class Placement:
    """Where a model is scored: the device and precision asked ("auto": hardware.plan decides) and whether a model
    name may be downloaded."""

    device: str = "auto"
    precision: str = "auto"
    allow_download: bool = False


@dataclass(frozen=True)
class LmEvalAsk:
    """lm-evaluation-harness's side of `tunebench eval`: its tasks (comma-separated), the JSONL tunebench's local
    tasks read, a sample limit a task, and a directory of the user's own task YAMLs."""

    tasks: str
    data: str | None = None
    limit: int | None = None
    include: str | None = None


def table(model: str | None, adapters: list[str | None], base: bool, data: DataConfig, output_dir: str, *,
          batch_size: int, where: Placement, generate: int, max_new_tokens: int,
          lm_eval_ask: LmEvalAsk | None = None, ggufs: list[str] = ()) -> None:
    """`tunebench eval`: each model (the base with `base`, and each adapter) on the same rows, one table; with
    `lm_eval_ask`, lm-evaluation-harness's tasks instead (its local tasks read its `data`). Each of `ggufs`
    (a run's export) answers the same rows in llama.cpp, a row of the same table."""
    if base and adapters == [None]:
        raise TunebenchError("--base compares a base model with its adapters; give --adapter too")
    check_ggufs(ggufs, generate, adapters[0] or model)
    chosen = [("base", model or trained_on(adapters[0]), None)] if base else []
    chosen += [(label_of(model, a), model, a) for a in adapters]
    labels = [label if [c[0] for c in chosen].count(label) == 1 else f"{label}-{i + 1}"
              for i, (label, _, _) in enumerate(chosen)]
    out = Path(output_dir)
    if lm_eval_ask:
        for label, (_, spec, adapter) in zip(labels, chosen):
            result = lm_eval(spec, adapter, lm_eval_ask, batch_size, where, out / label)
            print(json.dumps({"label": label, **result}, indent=2))
        return
    results = [(label, run(spec, adapter, data, batch_size, where=where, generate=generate,
                           max_new_tokens=max_new_tokens, answers=out / f"answers-{label}.jsonl",
                           split_of=adapters[0]))
               for label, (_, spec, adapter) in zip(labels, chosen)]
    for path in ggufs:
        label = f"{Path(path).stem} (llama.cpp)"
        results.append((label, run_gguf(path, adapters[0] or model, data, generate, max_new_tokens,
                                        out / f"answers-{Path(path).stem}-llama.cpp.jsonl")))
    if generate:
        write_json(out / "scores.json", {label: r for label, r in results})
    print(json.dumps(results[0][1], indent=2) if len(results) == 1 else side_by_side(results))
    if generate:
        print(f"answers and scores in {out}/ (answers-MODEL.jsonl, scores.json); generated for "
              f"{results[0][1]['generated_from']}")


def run(model: str | None, adapter: str | None, data: DataConfig, batch_size: int = 8, seed: int = 42,
        where: Placement = Placement(), generate: int = 0, max_new_tokens: int = 128, answers: Path | None = None,
        split_of: str | None = None, template: str | None = None) -> dict:
    """Loss (and, with `generate`, task scores) of one model. `split_of`: the run directory whose held-out
    rows and prompt format the answers use (default: the adapter's, or the model's when it is a run);
    `template` overrides that prompt format."""
    if generate < 0 or max_new_tokens < 1:
        raise TunebenchError(f"--generate must be 0 or more and --max-new-tokens 1 or more, got {generate} and "
                             f"{max_new_tokens}")
    examples = formats.load_examples(data)  # bad data is refused before the model loads
    plan = hardware.plan(where.device, where.precision, hardware.detect(), "off")
    runner.apply_plan(plan)
    placed = inference.load(model, adapter, None, where.allow_download, plan=plan)  # the loss and the answers alike
    tokenized = load_tokenized(data, placed.tokenizer, models.cache_dir(), examples)
    idx, _ = split(len(tokenized), 0.0, seed, data.max_samples)
    if len(idx) == 0:
        raise TunebenchError(f"dataset '{data.path}' has no rows to evaluate")
    batches = batching.eval_batches(tokenized, idx, batch_size, placed.tokenizer.pad_token_id)
    result = evaluate(CausalLMLoss(placed.model, placed.autocast_dtype), batches, placed.device)
    out = {"model": placed.source, "rows": len(idx), "device": plan.device, "precision": plan.precision, **result}
    if generate:

        rows, where = held_out(examples, tokenized, data, split_of or adapter or model)
        template = template or trained_template(adapter, split_of, model)
        scores = quality.evaluate_task(placed, rows[:generate], template, max_new_tokens,
                                       answers or Path("answers.jsonl"), seed)
        out.update(generated=min(generate, len(rows)), generated_from=where, **scores)
    return out


def check_ggufs(ggufs, generate: int, run_dir: str | None) -> None:
    """--gguf is refused before anything loads without answers to score, a run to prompt it as, or the file."""
    if not ggufs:
        return

    if not generate:
        raise TunebenchError("--gguf scores the file's answers: give --generate N (the held-out rows to answer)")
    if run_dir is None or not RunDir(run_dir).config_file.is_file():
        raise TunebenchError("--gguf needs the run it was exported from, for its tokenizer, prompt format and held-out "
                             "rows: give --adapter RUN_DIR (or --model RUN_DIR for a full fine-tune)")
    for path in ggufs:
        if not Path(path).is_file() or not str(path).endswith(".gguf"):
            raise TunebenchError(f"--gguf {path} is not a .gguf file; pass the file `tunebench export` wrote")
    llama_cpp_tools.check_available(converter_needed=False)


def run_gguf(path: str, run_dir: str, data: DataConfig, generate: int, max_new_tokens: int, answers: Path) -> dict:
    """The exported file's scores on the rows `run` scores the run on, with llama.cpp generating; its size."""
    held = HeldOut.of(run_dir, data)
    scores = held.score_gguf(Path(path), generate, max_new_tokens, answers)
    scores.pop("per_row")  # what `export --quant auto` compares types on; eval reports the means
    return scores


@dataclass(frozen=True)
class HeldOut:
    """A run's tokenizer, prompt format and held-out rows: what an export of it is scored on."""
    tok: object
    template: str
    rows: list
    where: str

    @classmethod
    def of(cls, run_dir: str, data: DataConfig) -> HeldOut:

        tok = models.load_tokenizer(run_dir)
        examples = formats.load_examples(data)
        tokenized = load_tokenized(data, tok, models.cache_dir(), examples)
        rows, where = held_out(examples, tokenized, data, run_dir)
        return cls(tok, trained_template(run_dir), rows, where)

    def score_gguf(self, path: Path, generate: int, max_new_tokens: int, answers: Path) -> dict:
        """The file's answers to the first `generate` rows, in llama.cpp, scored and written to `answers`."""
        found, seconds = quality.generate_answers_gguf(path, self.tok, self.rows[:generate], self.template,
                                                       max_new_tokens)
        scores = quality.score(found, seconds)
        quality.write_answers(answers, found, scores)
        return {"model": str(path), "runtime": "llama.cpp", "file_mb": round(path.stat().st_size / 2**20, 1),
                "generated": len(found), "generated_from": self.where, **scores,
                "per_row": {m: quality.row_scores(found, m) for m in quality.OBJECTIVES}}


def held_out(examples: formats.Examples, tokenized, data: DataConfig, run_dir: str | None) -> tuple[list, str]:
    """The rows to generate for: a training run's own held-out rows (its seed and eval fraction) when this is
    its data, else every row of the dataset (none of it was trained on)."""
    run = RunDir(run_dir) if run_dir else None
    if run is not None and run.config_file.is_file() and run.kind() != "pretrain":
        cfg = run.train_config()
        d = cfg.data
        trained_files = [d.path] + [path for path, _ in d.sources]  # a mixture splits each of its datasets alike
        if any(Path(p).resolve() == Path(data.path).resolve() for p in trained_files):
            _, eval_idx = split(len(tokenized), d.eval_fraction, cfg.schedule.seed, d.max_samples, d.eval_samples)
            if len(eval_idx) == 0:
                raise TunebenchError(f"'{run_dir}' held no rows out of '{data.path}' (eval_fraction 0): its answers "
                                     "there would be to training rows; pass --data with other rows")
            return [examples.messages[tokenized.rows[i]] for i in eval_idx], f"the held-out rows of {run_dir}"
    return list(examples.messages), f"the rows of {data.path}"


COLUMNS = (("rows", "{:d}"), ("file_mb", "{:.1f}"), ("eval_loss", "{:.4f}"), ("perplexity", "{:.2f}"),
           *((k, f"{{:.{quality.DIGITS[k]}f}}" + ("%" if k == "eos_rate" else "")) for k in quality.METRICS),
           *((k, f"{{:.{quality.DIGITS[k]}f}}%") for k in quality.TOOL_SCORES))  # where the rows offer tools


def side_by_side(results: list[tuple[str, dict]]) -> str:
    """One row per model, the columns any of them has."""
    shown = [(k, f) for k, f in COLUMNS if any(r.get(k) is not None for _, r in results)]
    head = ["model"] + [k for k, _ in shown]
    body = [[label] + [("-" if r.get(k) is None else f.format(r[k])) for k, f in shown] for label, r in results]
    widths = [max(len(str(row[i])) for row in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + body)


def label_of(model: str | None, adapter: str | None) -> str:
    name = Path(adapter).name if adapter else (model or models.SMOLLM2)
    return re.sub(r"[^\w.-]+", "-", str(name)).strip("-") or "model"


LM_EVAL_TASKS = Path(__file__).resolve().parents[1] / "configs" / "lm_eval"  # tunebench's local tasks


def lm_eval(model: str | None, adapter: str | None, ask: LmEvalAsk, batch_size: int = 8, where: Placement = Placement(),
            output: Path | None = None) -> dict:
    """EleutherAI's lm-evaluation-harness on the merged model: its tasks, prompts, filters and metrics.
    tunebench's local tasks (gsm8k_local) read `data` instead of downloading a dataset; `include` adds a
    directory of your own task YAMLs."""
    tasks, data, limit, include = ask.tasks, ask.data, ask.limit, ask.include
    if importlib.util.find_spec("lm_eval") is None:
        raise TunebenchError("--lm-eval needs EleutherAI's lm-evaluation-harness: pip install 'tunebench[lm-eval]' "
                             "(or pip install lm-eval)")
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    local = {p.stem for p in LM_EVAL_TASKS.glob("*.yaml")}
    if any(n in local for n in names) and not (data and Path(data).is_file()):
        raise TunebenchError(f"the local task(s) {', '.join(n for n in names if n in local)} read a GSM8K-style JSONL: "
                             "pass it with --data FILE")
    if limit is not None and limit < 1:
        raise TunebenchError(f"--lm-eval-limit must be 1 or more, got {limit}")
    if include and not Path(include).is_dir():
        raise TunebenchError(f"--lm-eval-include '{include}' is not a directory of task YAMLs")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        for task in LM_EVAL_TASKS.glob("*.yaml"):  # the local tasks, with the data file filled in
            text = task.read_text().replace("DATA_FILE", json.dumps(str(Path(data).resolve())) if data else "null")
            (Path(tmp) / task.name).write_text(text)
        # lm-eval's own ~15,000 task YAMLs take seconds to index: read only where a task may be one of them
        manager = TaskManager(include_path=[tmp] + ([include] if include else []),
                              include_defaults=bool(include) or not set(names) <= local)
        unknown = [n for n in names if n not in manager.all_tasks]
        if unknown:  # before the model loads
            raise TunebenchError(f"lm-eval knows no task {', '.join(unknown)}; tunebench's local ones: "
                                 f"{', '.join(sorted(local))}; or pass --lm-eval-include DIR with your task YAMLs")
        placed = inference.load(model, adapter, None, where.allow_download, where.device, where.precision)
        if adapter:
            placed.model = placed.model.merge_and_unload()
        with placed.running():  # lm-eval calls the model in this thread: under the run's autocast
            lm = HFLM(pretrained=placed.model, tokenizer=placed.tokenizer, batch_size=batch_size,
                      device=str(placed.device))
            result = simple_evaluate(model=lm, tasks=names, limit=limit, task_manager=manager, log_samples=True)
    scores = {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not k.startswith("alias")}
              for task, metrics in result["results"].items()}
    if output is not None:  # the scores, and every sample's target and answer, for a person to read

        write_json(output / "lm_eval.json", {"model": placed.source, "results": scores})
        with atomic_file(output / "lm_eval_samples.jsonl") as tmp:
            tmp.write_text("".join(json.dumps({"task": task, "target": s.get("target"), "response": s.get("resps"),
                                               "filtered": s.get("filtered_resps")}, default=str) + "\n"
                                   for task, samples in result.get("samples", {}).items() for s in samples))
    return {"model": placed.source, "lm_eval": scores}
