"""`tunebench tune`: hyperparameter search over `train` or `pretrain` runs, on Optuna.

Optuna does the searching: its samplers (TPE, random), its median pruner and its storage (an SQLite
file in the output directory, or any RDB URL that several machines share). tunebench runs each trial
as its own `tunebench train|pretrain` process through compare's runner, so a crash or an OOM is a
failed trial and not a dead search, and judges every trial by its validation loss at an equal token
budget. What tunebench adds by hand is only that runner loop: Optuna's `optimize` would call the
objective in this process, and a trial here is another process that reports its evals as it goes.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tunebench.core.durable import atomic_file
from tunebench.core.errors import TunebenchError
from tunebench.jobs import children, compare, report
from tunebench.jobs.report import png
from tunebench.jobs.search_space import Param, check, load_space, space_path
from tunebench.model import quality
from tunebench.settings import pretrain as pretrain_config
from tunebench.settings.rundir import RunDir

MAX_DUPLICATES = 30  # proposals in a row that repeat earlier trials: the space is exhausted
SAME_FAILURES = 3  # trials in a row failing with one message: a setting they share is wrong, not a choice
EVALS = 4  # evals per trial, at 1/4, 2/4, 3/4 and the end of its budget: the points the pruner compares
# What a trial is judged by: eval loss (lower is better, judged while it runs), or a task metric of its
# answers to held-out rows at the end (train.eval_generate; higher is better).
OBJECTIVES = {"eval_loss": "minimize", **dict.fromkeys(quality.TASK_OBJECTIVES, "maximize"),
              "reward_accuracy": "maximize"}  # the last: DPO/ORPO runs' held-out pairs
TASK_ROWS = 16  # held-out rows a trial answers when the objective is a task metric and train.eval_generate is unset
KEYS = {"budget": "schedule.max_tokens", "steps": "schedule.max_steps", "eval": "evaluation.eval_steps"}  # set on every trial


def fingerprint(job: str, config: str | None, base: dict[str, Any], space: str, objective: str = "eval_loss") -> str:
    """What makes a study the same search: a rerun with another space, config or budget is refused."""
    if config and job == "pretrain":
        config = str(pretrain_config.config_path(config))
    text = json.dumps({"job": job, "config": Path(config).read_text() if config else None,
                       "base": {k: str(v) for k, v in sorted(base.items())},
                       "space": space_path(space).read_text(),
                       **({"objective": objective} if objective != "eval_loss" else {})}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def counted(trial) -> bool:
    """A trial that counts towards --trials: finished, pruned, or failed with a result row (its run
    failed); not one cut short by Ctrl-C, left stale by a killed search, or dropped as a duplicate."""
    import optuna

    S = optuna.trial.TrialState
    return trial.state in (S.COMPLETE, S.PRUNED) or (trial.state == S.FAIL and "row" in trial.user_attrs)


HEARTBEAT_S, GRACE_S = 10, 60  # a RUNNING trial whose search has not said it is alive for GRACE_S is stale


def hide_password(url: str) -> str:
    """A storage URL fit to print: postgresql://user:***@host/db, read by SQLAlchemy's own URL parser (what
    optuna connects with), a `password=` query parameter masked too. A user part holding a second '@' (an
    unescaped one in the password) is masked whole: parsers disagree on where such a password ends."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    scheme, sep, rest = url.partition("://")
    authority = rest.split("/", 1)[0]
    if sep and authority.count("@") > 1:
        return f"{scheme}://***@{rest[authority.rindex('@') + 1:]}"
    try:
        parsed = make_url(url)
    except ArgumentError:
        return "(a storage URL SQLAlchemy cannot read)"
    query = {k: "***" if "password" in k.lower() else v for k, v in parsed.query.items()}
    return parsed.set(query=query).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


def open_study(out: Path, storage: str | None, name: str, sampler: str, pruner: str, seed: int, mark: str,
               direction: str = "minimize"):
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = storage or f"sqlite:///{(out / 'study.sqlite').resolve()}"
    shown = hide_password(url)
    samplers = {"tpe": lambda: optuna.samplers.TPESampler(seed=seed),
                "random": lambda: optuna.samplers.RandomSampler(seed=seed)}
    # A trial's first eval is its first quarter: judge it from there on, once 2 trials have finished.
    pruners = {"median": lambda: optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0),
               "none": lambda: optuna.pruners.NopPruner()}
    for attempt in range(4):
        try:
            # Heartbeats: a search killed with -9 leaves its trial RUNNING; the next search marks it failed
            # (not counted) and runs its choices again.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats: since 2.x
                rdb = optuna.storages.RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                                                 heartbeat_stale_trial_callback=_run_again)
            study = optuna.create_study(storage=rdb, study_name=name, direction=direction, load_if_exists=True,
                                        sampler=samplers[sampler](), pruner=pruners[pruner]())
            break
        except Exception as e:  # noqa: BLE001 - a bad URL or an unreachable database: one line, before any trial
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            # Two searches starting together race to create the same tables or study: the loser tries again.
            if attempt < 3 and any(k in message for k in ("already exists", "duplicate key", "UNIQUE constraint")):
                time.sleep(1.0 + attempt)
                continue
            raise TunebenchError(f"cannot open the study storage '{shown}': {message.replace(url, shown)}; "
                                 "check --storage") from None
    _fail_stale(study)
    held = study.user_attrs.get("fingerprint")
    if held is None:
        study.set_user_attr("fingerprint", mark)
    elif held != mark:
        raise TunebenchError(f"the study '{name}' in {shown} was a search with another space, config or budget; "
                             "pass another --output-dir or --study-name to start a new one")
    return study


def exhausted(study, params: list[Param]) -> bool:
    """Every choice of an all-list space has run (or is running): nothing is left to propose."""
    if any(p.choices is None for p in params):
        return False
    total = math.prod(len(set(p.choices)) for p in params)
    seen = {tuple(sorted(t.params.items())) for t in study.get_trials(deepcopy=False)
            if t.params and holds_its_choice(t)}
    return len(seen) >= total


def _exhausted_error(study, trials: int) -> TunebenchError:
    """Why no trial is left to run: every trial failed alike (a shared setting is wrong), or the space is used up."""
    import optuna

    S = optuna.trial.TrialState
    ran = [t for t in study.get_trials(deepcopy=False) if counted(t)]
    failed = {t.user_attrs["row"].get("message", "") for t in ran if t.state == S.FAIL}
    if ran and len(failed) == 1 and all(t.state == S.FAIL for t in ran):
        return TunebenchError(f"the last {len(ran)} trials all failed the same way ({failed.pop()}), and the space "
                              "has no other choice to try; fix that and rerun the same command")
    return TunebenchError(f"every choice of the space has run: it has no untried choice left for {trials} trials; "
                          "widen the space or ask for fewer --trials")


def _fail_stale(study) -> None:
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # in Optuna since 2.9
        optuna.storages.fail_stale_trials(study)


def _run_again(study, trial) -> None:
    """A stale trial's choices run again first (Optuna's heartbeat marked it failed)."""
    study.enqueue_trial(trial.params)


def holds_its_choice(trial) -> bool:
    """A trial whose choices are taken: running, finished, pruned, or failed with a result row (a stale,
    interrupted or duplicate trial gives its choices back)."""
    return trial.state.name == "RUNNING" or counted(trial)


def duplicate_of(study, trial) -> int | None:
    """The number of an earlier trial with the same choices that ran or runs, if any: two searches on one
    study (or a sampler that repeats itself) never run a choice twice."""
    for other in study.get_trials(deepcopy=False):
        if other.number < trial.number and other.params == trial.params and holds_its_choice(other):
            return other.number
    return None


def trial_settings(params: dict[str, Any]) -> str:
    return " ".join(f"{k.rsplit('.', 1)[-1]}={v:.3g}" if isinstance(v, float) else f"{k.rsplit('.', 1)[-1]}={v}"
                    for k, v in params.items())


def evals_of(run_dir: Path, seen: int) -> tuple[list[tuple[int, float]], int]:
    """New (eval index 1..EVALS, loss) records in a running trial's metrics.jsonl after the first `seen` lines."""
    path = run_dir / "metrics.jsonl"
    plan = run_dir / "plan.json"
    if not path.is_file() or not plan.is_file():
        return [], seen
    text = path.read_text()
    complete = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]  # a line being written waits
    total = next((d["value"] for d in json.loads(plan.read_text())["decisions"] if d["setting"] == "total_steps"), None)
    found = []
    for line in complete[seen:]:
        record = json.loads(line)
        if "eval_loss" in record and record["step"] > 0 and total:
            found.append((max(1, round(EVALS * record["step"] / int(total))), record["eval_loss"]))
    return found, len(complete)


def _follow(proc, trial, run_dir: Path, report: bool = True) -> tuple[int, tuple[int, float] | None]:
    """Report a running trial's evals to the pruner as they appear (when the objective is the eval loss);
    stop it (with a checkpoint) when pruned. Returns (metrics lines read, (eval index, loss) it was pruned
    at, or None)."""
    seen = 0
    while proc.poll() is None:
        _stopped()
        time.sleep(0.5)
        if not report:
            continue
        found, seen = evals_of(run_dir, seen)
        for index, loss in found:
            if index >= EVALS:  # the final eval is the trial's result, not a point to stop it at
                continue
            trial.report(loss, index)
            if trial.should_prune():
                children.stop(proc)
                return seen, (index, loss)
    return seen, None


def run_trial(study, trial, job: str, config: str | None, base: dict[str, Any], params: list[Param], out: Path,
              device: str | None, objective: str = "eval_loss") -> dict[str, Any] | None:
    """One trial: its process, its evals reported to the pruner as they appear; returns its results row
    (None: its choices duplicate an earlier trial's, so it did not run)."""
    import optuna

    try:
        chosen = {p.key: p.suggest(trial) for p in params}
        earlier = duplicate_of(study, trial)
        if earlier is None and not isinstance(study._storage, optuna.storages.InMemoryStorage):
            time.sleep(0.3)  # another search's choice made at the same moment has landed by now
            earlier = duplicate_of(study, trial)
    except BaseException:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)  # never left RUNNING
        raise
    if earlier is not None:
        trial.set_user_attr("duplicate_of", earlier)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        return None
    run_dir = out / "trials" / f"trial-{trial.number:03d}"
    print(f"trial {trial.number}: {trial_settings(chosen)}", flush=True)
    t0 = time.perf_counter()
    seen, pruned_at, proc = 0, None, None
    beat = Heartbeat(study._storage, trial._trial_id)
    try:
        if hasattr(study._storage, "record_heartbeat"):  # alive before the thread's first beat
            study._storage.record_heartbeat(trial._trial_id)
        proc = compare.start(job, {**base, **compare.canonical(job, chosen)}, run_dir, device, config=config)  # forked before any thread
        beat.start()
        seen, pruned_at = _follow(proc, trial, run_dir, objective == "eval_loss")
    except BaseException as e:  # the trial's process never outlives the search, and the trial never stays RUNNING
        beat.stop()
        if proc is not None:
            children.stop(proc)  # it stops with a checkpoint
        if isinstance(e, KeyboardInterrupt):  # Ctrl-C or SIGTERM: not counted; its choices run next time
            trial.set_user_attr("interrupted", True)
            study.enqueue_trial(trial.params)
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise
    beat.stop()
    finished = RunDir(run_dir).summary() if proc.returncode == 0 else None
    used = finished.device if finished else None
    row = compare.finish(proc, run_dir, used or device or "auto")
    if row["status"] == "ok" and objective == "eval_loss":
        found, seen = evals_of(run_dir, seen)
        for index, loss in found:
            if index < EVALS:
                trial.report(loss, index)
    row |= {"experiment": f"trial-{trial.number}", "config": trial_settings(chosen), "repeat": 1}
    if pruned_at is not None:
        row |= {"status": "pruned", "message": f"pruned at eval {pruned_at[0]} of {EVALS}: loss {pruned_at[1]:.4f}, "
                                               "worse than the median of earlier trials there"}
    trial.set_user_attr("row", {k: v for k, v in row.items() if v is not None})
    trial.set_user_attr("wall_s", round(time.perf_counter() - t0, 1))
    if row["status"] == "ok" and row.get(objective) in (None, ""):
        row |= {"status": "error", "message": f"the run reported no {objective}"
                + (": the references are not GSM8K-style (#### answer)" if objective == "exact_match" else
                   ": the held-out rows offer no tools" if objective in quality.TOOL_SCORES else "")}
        trial.set_user_attr("row", {k: v for k, v in row.items() if v is not None})
    if row["status"] == "ok":
        trial.set_user_attr("config", (run_dir / "config.yaml").read_text())
        study.tell(trial, float(row[objective]))
        shown = "" if objective == "eval_loss" else f"{objective} {float(row[objective]):.2f}, "
        print(f"  {shown}eval loss {float(row['eval_loss']):.4f}, {float(row['tokens_per_s'] or 0):,.0f} tokens/s, "
              f"{trial.user_attrs['wall_s']:.0f} s", flush=True)
    elif row["status"] == "pruned":
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        print(f"  {row['message']}", flush=True)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        print(f"  failed ({row['status']}): {row.get('message') or 'no eval loss'}", flush=True)
    return row


def write_results(study, path: Path) -> None:
    """Every counted trial's row, in compare's CSV schema, rewritten whole (from the study, so a shared
    database gives every machine the whole search)."""
    rows = [t.user_attrs["row"] for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
            if counted(t) and "row" in t.user_attrs]
    with atomic_file(path) as tmp, tmp.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=compare.SCHEMA)
        w.writeheader()
        for row in rows:
            w.writerow({k: row.get(k, "") for k in compare.SCHEMA})


def write_best(study, job: str, out: Path) -> Path | None:
    """The best trial's whole configuration as a YAML that `tunebench train|pretrain` runs as is."""
    import optuna

    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if "config" in t.user_attrs]
    if not done:
        return None
    best = (max if study.direction == optuna.study.StudyDirection.MAXIMIZE else min)(done, key=lambda t: t.value)
    cfg = yaml.safe_load(best.user_attrs["config"])
    cfg["output"].update({"output_dir": str(out / "best-run"), "overwrite": False, "resume": None})
    cfg["logging"]["progress"] = True
    path = out / "best.yaml"
    header = (f"# tunebench tune: the best of {len(done)} finished trial(s), trial {best.number}, "
              f"{study.user_attrs.get('objective', 'eval_loss')} {best.value:.4f}\n# {trial_settings(best.params)}\n# run it: tunebench {job} {path}\n")
    with atomic_file(path) as tmp:
        tmp.write_text(header + yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def charts(study) -> list[tuple[str, bytes]]:
    """Optuna's own plots: the optimisation history, parameter importances, and the loss against each
    parameter. A plot that needs more finished trials than there are is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ov


    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib backend experimental
        for name, plot in (("optimization_history", ov.plot_optimization_history),
                           ("param_importances", ov.plot_param_importances), ("loss_vs_params", ov.plot_slice)):
            try:
                axes = plot(study)
            except (ValueError, RuntimeError, ZeroDivisionError):
                continue
            first = axes.flat[0] if hasattr(axes, "flat") else axes
            fig = first.figure
            if not fig.get_axes() or not any(a.has_data() for a in fig.get_axes()):
                plt.close(fig)
                continue
            out.append((name, png(fig)))
    return out


@dataclass(frozen=True)
class Search:
    """What `tunebench tune` asks for: a study of `trials` runs of `job` over the search `space`."""

    job: str  # train | pretrain
    config: str | None  # the job's YAML, if any
    overrides: dict[str, Any]  # dotted settings every trial shares
    space: str  # a search-space YAML, or a shipped space's name
    trials: int
    out_dir: str  # the study database, the trials, results.csv, best.yaml, report/
    sampler: str = "tpe"
    pruner: str = "auto"  # median while eval_loss is the objective, none otherwise
    budget_tokens: int | None = None  # a trial's length in real tokens, whatever its batch
    max_steps: int | None = None  # or in steps
    storage: str | None = None  # a shared study's database URL (PostgreSQL); default out_dir/study.sqlite
    study_name: str = "tunebench"
    device: str | None = None
    seed: int = 42  # the sampler's
    objective: str = "eval_loss"  # or a task metric, or reward_accuracy


def run(s: Search) -> dict:
    """`tunebench tune`: the study opened (or resumed), its trials run to `s.trials`, the best written."""
    pruner = _pruner(s)
    base = _trial_base(s, pruner)
    params = load_space(s.space)
    check(s.job, s.config, base, params)
    out = Path(s.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    study = open_study(out, s.storage, s.study_name, s.sampler, pruner, s.seed,
                       fingerprint(s.job, s.config, base, s.space, s.objective), OBJECTIVES[s.objective])
    study.set_user_attr("objective", s.objective)
    base = compare.tracked(s.job, s.config, base, s.study_name)  # after the fingerprint: an older study still resumes
    _run_trials(study, s, base, params, out)
    return _finish(study, s, out)


def _pruner(s: Search) -> str:
    """The pruner the study runs with, after every setting of `s` that cannot hold is refused."""
    job, objective, pruner = s.job, s.objective, s.pruner
    if objective not in OBJECTIVES:
        raise TunebenchError(f"--objective '{objective}' is not one of {', '.join(OBJECTIVES)}")
    if pruner == "auto":  # the median pruner compares eval losses mid-run; a task metric exists only at the end
        pruner = "median" if objective == "eval_loss" else "none"
    elif pruner == "median" and objective != "eval_loss":
        raise TunebenchError(f"--pruner median stops trials by their eval loss while they run, and {objective} is "
                             "known only at a trial's end; use --pruner none (the default for a task objective)")
    if s.trials < 1:
        raise TunebenchError(f"--trials must be 1 or more, got {s.trials}")
    if s.budget_tokens is not None and s.budget_tokens < 1:
        raise TunebenchError(f"--budget-tokens must be 1 or more, got {s.budget_tokens}")
    if objective == "reward_accuracy" and job != "train":
        raise TunebenchError("--objective reward_accuracy judges DPO/ORPO runs by their held-out pairs; "
                             "`tune --job pretrain` runs have none")
    if objective not in ("eval_loss", "reward_accuracy") and job != "train":
        raise TunebenchError(f"--objective {objective} scores answers to prompts, which `tune --job pretrain` "
                             "runs do not have; use --objective eval_loss")
    if s.budget_tokens is not None and s.max_steps is not None:
        raise TunebenchError("--budget-tokens and --max-steps both set a trial's length; give one of them")
    return pruner


def _trial_base(s: Search, pruner: str) -> dict[str, Any]:
    """Every trial's settings before the space's: the overrides, the trial's length, its evaluations, the rows a
    task objective scores (said, with the pruner)."""
    keys, objective = KEYS, s.objective
    base = compare.canonical(s.job, dict(s.overrides))
    if s.budget_tokens is not None:
        base |= {keys["budget"]: s.budget_tokens, keys["steps"]: None}
    elif s.max_steps is not None:
        base |= {keys["steps"]: s.max_steps, keys["budget"]: None}
    base[keys["eval"]] = 1 / EVALS
    if objective == "reward_accuracy":
        print(f"objective: reward accuracy on each trial's held-out preference pairs (maximized); pruner {pruner}")
    elif objective != "eval_loss":
        if base.get("evaluation.eval_generate") == 0:
            raise TunebenchError(f"--objective {objective} needs answers to score, and eval_generate is 0; "
                                 f"leave it unset ({TASK_ROWS} rows) or give a number")
        base.setdefault("evaluation.eval_generate", TASK_ROWS)
        print(f"objective: {objective} of each trial's answers to {base['evaluation.eval_generate']} held-out rows "
              f"(maximized); pruner {pruner}")
    return base


def _run_trials(study, s: Search, base: dict[str, Any], params: list[Param], out: Path) -> None:
    """Trials asked of the study and run, one at a time, until it holds `s.trials` finished ones (this search's
    and any other's on the same storage); Ctrl-C or SIGTERM leaves the running trial to be run again."""
    trials = s.trials

    def finished() -> int:
        return sum(counted(t) for t in study.get_trials(deepcopy=False))

    done = finished()
    print(f"study '{s.study_name}' ({hide_password(s.storage) if s.storage else out / 'study.sqlite'}): {done} of "
          f"{trials} trials already done" + (", resuming" if done else ""), flush=True)
    STOP.clear()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    failures: list[str] = []  # this process's trials' failures, while none has succeeded
    try:
        duplicates = 0
        while finished() < trials:
            import optuna

            _stopped()
            _fail_stale(study)  # another search's trial whose process died: run it again
            with warnings.catch_warnings():  # we keep the heartbeat ourselves, as optimize() would
                warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
                trial = study.ask()
            row = run_trial(study, trial, s.job, s.config, base, params, out, s.device, s.objective)
            if row is None:
                if any(t.state == optuna.trial.TrialState.RUNNING for t in study.get_trials(deepcopy=False)):
                    time.sleep(2.0)  # what is left may be running elsewhere: its end may finish the study
                    continue
                if finished() >= trials:  # another search's last trial ended since the ask: the study is done
                    continue
                duplicates += 1
                if duplicates >= MAX_DUPLICATES or exhausted(study, params):
                    raise _exhausted_error(study, trials)
                continue
            duplicates = 0
            write_results(study, out / "results.csv")
            failures = failures + [row.get("message", "")] if row["status"] in ("error", "oom") else []
            if len(failures) >= SAME_FAILURES and len(set(failures)) == 1 and finished() < trials:
                raise TunebenchError(f"the last {len(failures)} trials all failed the same way ({failures[0]}); "
                                     "fix that and rerun the same command to go on with the search")
    except KeyboardInterrupt:
        write_results(study, out / "results.csv")
        raise TunebenchError("interrupted: the running trial is marked so and will be run again; rerun the same "
                             "command to resume the search", 130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _finish(study, s: Search, out: Path) -> dict:
    """The results, best.yaml and the report written; the summary `run` returns."""
    objective = s.objective
    write_results(study, out / "results.csv")
    best_path = write_best(study, s.job, out)
    summary: dict[str, Any] = {"trials": sum(counted(t) for t in study.get_trials(deepcopy=False)),
                               "results": str(out / "results.csv"), "best_yaml": None}
    if best_path is None:
        print(f"no trial finished with {objective}; see the trials' log.txt under " + str(out / "trials"))
        return summary

    html = report.write([str(out / "results.csv")], str(out / "report"), extra_charts=charts(study))
    best = study.best_trial
    summary |= {"best_trial": best.number, f"best_{objective}": best.value, "best_params": best.params,
                "best_yaml": str(best_path), "report": str(html), "objective": objective}
    print(f"best: trial {best.number}, {objective.replace('_', ' ')} {best.value:.4f} ({trial_settings(best.params)})")
    print(f"best configuration: {best_path}  (tunebench {s.job} {best_path})")
    print(f"results: {out / 'results.csv'}; report: {html.resolve()}")
    return summary


class Heartbeat:
    """A running trial's heartbeat in the study's storage (Optuna's RDB heartbeat: record_heartbeat every interval,
    which another search reads to tell a dead trial from a live one), as Optuna's optimize() keeps it. Written here
    because Optuna's HeartbeatThread is not a daemon and is stopped only by its `with` block's exit: a SIGTERM
    raising inside its start, the moment a trial has started, skipped that exit and left it beating, and the search
    printed its error and never exited (the interrupted-search test timed out so in CI, 2026-11-28). This thread is
    a daemon, and `stop` ends it whether or not its start was cut short."""

    def __init__(self, storage, trial_id: int):
        from optuna.storages._heartbeat import is_heartbeat_enabled

        self.storage, self.trial_id, self.done = storage, trial_id, threading.Event()
        self.interval = storage.get_heartbeat_interval() if is_heartbeat_enabled(storage) else None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval:
            self.thread = threading.Thread(target=self._beat, daemon=True, name="tunebench-trial-heartbeat")
            self.thread.start()

    def _beat(self) -> None:
        while not self.done.is_set():
            self.storage.record_heartbeat(self.trial_id)
            self.done.wait(self.interval)

    def stop(self) -> None:
        self.done.set()
        if self.thread is not None and self.thread.is_alive():
            self.thread.join(30)


STOP = threading.Event()  # SIGTERM seen: kept, as the raise below can land where Python swallows it


def _raise_interrupt(signum, frame):
    # Raised in whatever the main thread runs; inside a finalizer or an at-fork hook (logging's, while a trial's
    # process starts) Python prints "Exception ignored" and goes on, so the flag stays set for _follow and the
    # trial loop to raise again at their next look.
    STOP.set()
    raise KeyboardInterrupt


def _stopped() -> None:
    if STOP.is_set():
        raise KeyboardInterrupt

