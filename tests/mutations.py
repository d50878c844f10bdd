"""A suite that proves it can fail: plant one bug at a time (a one-line patch of the product), run the tests that
guard that line, and expect them to fail. Not part of `./run test` (it runs parts of the suite once per bug);
run it by hand (docs/development.md: before a trust change lands; it exits 1 when a row is not caught):

    .venv/bin/python tests/mutations.py            # every planted bug, a table at the end
    .venv/bin/python tests/mutations.py --list     # what is planted, and which tests are run against it
    .venv/bin/python tests/mutations.py NAME ...   # only these

Each bug's tests first run on the unpatched code (they must pass, or "caught" would mean nothing), then on the
patched file, which is restored whatever happens (Ctrl-C included). Hand-written rather than mutmut: mutmut
plants its own operator swaps everywhere, and these are the bugs the trust issues name, each aimed at a claim.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    name: str
    path: str  # relative to the repository
    old: str  # found exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments: files, -k selections
    deadline_s: float = 600.0  # past it the tests are stopped and the row reads HUNG: a revert must fail, not hang


BUGS = (
    Bug("every quant type scored on the f16 file", "src/tunebench/jobs/quant_auto.py",
        "row = _score(held, path, quant, settings, work)", "row = _score(held, reference, quant, settings, work)",
        ("tests/test_export.py", "-k", "quant_auto_picks or few_rows")),
    Bug("quant auto picks by the means again (no bound)", "src/tunebench/jobs/quant_auto.py",
        "    if low >= -settings.tolerance and len(row.per_row) >= MIN_ROWS:",
        "    if sum(row.per_row) / len(row.per_row) >= sum(ref.per_row) / len(ref.per_row) - settings.tolerance:",
        ("tests/test_export.py", "-k", "quant_auto_picks or few_rows")),
    Bug("a documented flag misspelled", "docs/guides/other-jobs.md",
        "tunebench hw --json ", "tunebench hw --jsn ",
        ("tests/test_docs.py", "-k", "every_documented_command_parses")),
    Bug("the memory plan's activation factor halved", "src/tunebench/training/autotune/memory.py",
        "TRANSIENT = {\"cpu\": 1.6,", "TRANSIENT = {\"cpu\": 0.8,",
        ("tests/test_memory_plan.py",)),
    Bug("the run lock not released after a refusal", "src/tunebench/core/runlock.py",
        "                release(key)", "                pass",
        ("tests/test_memory_plan.py", "-k", "cannot_fit")),
    Bug("an upload with a queued job (Job.argv)", "src/tunebench/interfaces/web/studio.py",
        "used = {str(job.cfg.data.path) for job in", "used = {a for job in",
        ("tests/test_studio.py", "-k", "upload_while")),
    Bug("a tool schema's remote $ref fetched", "src/tunebench/data/toolcalls.py",
        "return checker(schema, registry=Registry()).is_valid(call[\"arguments\"])",
        "return checker(schema).is_valid(call[\"arguments\"])",
        ("tests/test_quality.py", "-k", "tool")),
    Bug("DPO's reference pass under another autocast", "src/tunebench/training/preference.py",
        "                return token_logps(model, batch, index, autocast_dtype, temperature).detach()",
        "                return token_logps(model, batch, index, None, temperature).detach()",
        ("tests/test_preference.py", "-k", "closed_form")),
    Bug("resume restores the data position one micro-step late", "src/tunebench/training/checkpoint.py",
        "    return LoopState(**meta[\"loop\"])",
        "    return LoopState(**{**meta[\"loop\"], \"batch_in_epoch\": meta[\"loop\"][\"batch_in_epoch\"] + 1})",
        ("tests/test_loop.py", "-k", "resume_after_sigterm")),
    Bug("an ignored --max-length", "src/tunebench/data/tokenize.py",
        "        ex_ids, ex_mask = ex_ids[: cfg.max_length], ex_mask[: cfg.max_length]",
        "        ex_ids, ex_mask = ex_ids, ex_mask",
        ("tests/test_data.py", "-k", "truncation")),
    Bug("MLflow handed the password in its URI", "src/tunebench/machine/trackers.py",
        "        mlflow_credentials_apart()\n", "",
        ("tests/test_trackers.py", "-k", "all_four")),
    Bug("a child gets the server's secrets", "src/tunebench/core/childenv.py",
        "    env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}",
        "    env = dict(os.environ)",
        ("tests/test_serve.py", "-k", "secrets")),
    Bug("a stale export served as the run", "src/tunebench/interfaces/web/app.py",
        "        if kept == stamp or kept is None", "        if True or kept is None",
        ("tests/test_serve.py", "-k", "trained_again")),
    Bug("a start that raises wedges the queue", "src/tunebench/interfaces/web/studio.py",
        "                except Exception as e:  # noqa: BLE001 - whatever stops a start",
        "                except OSError as e:  # noqa: BLE001 - whatever stops a start",
        ("tests/test_studio.py", "-k", "start_that_raises")),
    Bug("a cross-site POST accepted", "src/tunebench/interfaces/web/openai_api.py",
        "                check_origin(request.headers)\n", "",
        ("tests/test_openai_api.py", "-k", "another_site")),
    Bug("a planted link followed", "src/tunebench/core/durable.py",
        "    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW |", "    flags = os.O_WRONLY | os.O_CREAT |",
        ("tests/test_durable.py", "-k", "symbolic")),
    Bug("the upload parsed whole in the web process", "src/tunebench/interfaces/web/studio.py",
        "    records = readers.read_records(d.path, limit=CHECK_ROWS)", "    records = readers.read_records(d.path)",
        ("tests/test_studio.py", "-k", "sample_of")),
    # round five
    Bug("a resume silently starting fresh", "src/tunebench/training/checkpoint.py",
        "    if resume == \"auto\":\n", "    if resume == \"auto\":\n        return None\n",
        ("tests/test_loop.py", "-k", "resume_after_sigterm and lora")),
    Bug("the RNG state not restored on resume", "src/tunebench/training/checkpoint.py",
        "        _set_rng_state(rngs[world.rank])", "        pass",
        ("tests/test_loop.py", "-k", "resume_after_sigterm and lora")),
    Bug("a user's file run from its path after its bytes were hashed", "src/tunebench/core/userfile.py",
        "        exec(compile(self.source, str(self.path), \"exec\"), module.__dict__)",
        "        importlib.util.spec_from_file_location(module_name, self.path).loader.exec_module(module)",
        ("tests/test_durable.py", "-k", "bytes_that_were_hashed")),
    Bug("the world size dropped from the loss scale", "src/tunebench/training/loop.py",
        "    scale = world.size / max(step_loss_tokens, 1)", "    scale = 1 / max(step_loss_tokens, 1)",
        ("tests/test_distributed.py", "-k", "two_lora_ranks_match")),
    Bug("each micro batch normalised by its own units", "src/tunebench/training/loop.py",
        "                    b[\"totals\"] = totals  # the whole step's", "                    pass  # the whole step's",
        ("tests/test_preference.py", "-k", "match_trl")),
    Bug("a filler rank adding loss", "src/tunebench/training/loop.py",
        "loss, stats = loss * b[\"live\"], None if stats is None else stats * b[\"live\"]", "loss, stats = loss, stats",
        ("tests/test_objectives_on_ranks.py", "-k", "grpo_on_two_ranks_matches")),
    Bug("GRPO's draws not seeded by rank", "src/tunebench/training/grpo/steps.py",
        "step_seed(self.seed, at.epoch, step // self.iterations, self.rank)",
        "step_seed(self.seed, at.epoch, step // self.iterations, 0)",
        ("tests/test_episodes.py", "-k", "two_ranks_each_drawing")),
    Bug("KTO's KL sums not added over the ranks", "src/tunebench/training/preference.py",
        "            distributed.sum_in_step(sums)", "            pass",
        ("tests/test_objectives_on_ranks.py", "-k", "preference_objectives_on_two_ranks and kto")),
    Bug("an episode's cache fed at the wrong positions", "src/tunebench/model/decoding.py",
        "positions = torch.tensor(fed, device=device)[:, None] + (chunk_mask", "positions = (chunk_mask",
        ("tests/test_decoding.py", "-k", "turns_keep")),
    Bug("a changed environment file run before its hash is checked", "src/tunebench/jobs/parts/grpo_run.py",
        "    if code and cfg.output.resume:", "    environment.load(o.environment, 1.0) if o.environment else None\n"
        "    if code and cfg.output.resume:",
        ("tests/test_shared_server.py", "-k", "environment_file_changed")),
    Bug("the GGUF read back compared with the model itself", "src/tunebench/jobs/export.py",
        "return compare(model, gguf_export.read_back(path, model.config), tokenizer,",
        "return compare(model, model, tokenizer,",
        ("tests/test_export.py", "-k", "wrong_rotary_row_order")),
    Bug("a restarted studio starting a queued run beside one an earlier server left training",
        "src/tunebench/interfaces/web/studio.py",
        "if job is None and self.queue and not self.left_running():", "if job is None and self.queue:",
        ("tests/test_studio.py", "-k", "one_run_at_a_time")),
    Bug("the measurement cache key without the precision", "src/tunebench/training/autotune/__init__.py",
        "return Key(kind, {**asdict(self), **extra})",
        "return Key(kind, {**{k: v for k, v in asdict(self).items() if k != \"precision\"}, **extra})",
        ("tests/test_plan.py", "tests/test_hardware.py")),
    Bug("a per-turn reward credited to the whole episode", "src/tunebench/training/grpo/__init__.py",
        "    if groups.token_advantages is not None:  # per-turn", "    if False:  # per-turn",
        ("tests/test_episodes.py", "-k", "process_supervision")),
    Bug("grouped attention reading the wrong key head for a query head", "src/tunebench/model/decoding.py",
        "    stacked = query.reshape(b * kv, groups * q, d)",
        "    stacked = query.view(b, groups, kv, q, d).transpose(1, 2).reshape(b * kv, groups * q, d)",
        ("tests/test_decoding.py", "-k", "grouped_attention")),
    Bug("a stop whose raise Python swallowed forgotten", "src/tunebench/training/stopping.py",
        "    if Phase.signalled:\n        raise _stopped", "    if False:\n        raise _stopped",
        ("tests/test_loop.py", "-k", "swallowed")),
    Bug("the studio's export timeout killing its child alone", "src/tunebench/interfaces/web/studio_views.py",
        "            os.killpg(proc.pid, signal.SIGKILL)\n        proc.communicate()",
        "            proc.kill()\n        proc.wait()",
        ("tests/test_shared_server.py", "-k", "past_its_time_limit")),
    Bug("a second Stop never escalating", "src/tunebench/interfaces/web/studio.py",
        "        if waited < STOP_GRACE_S:", "        if True:",
        ("tests/test_shared_server.py", "-k", "past_its_grace")),
    Bug("another site's page posting through a visitor's browser", "src/tunebench/interfaces/web/app.py",
        "        origin = headers.get(b\"origin\")", "        origin = None",
        ("tests/test_shared_server.py", "-k", "another_site")),
    Bug("the same-origin check only without a login", "src/tunebench/interfaces/web/app.py",
        "    middleware = [Middleware(SameOrigin, allowed={h.lower() for h in door.allowed_host})]",
        "    middleware = [Middleware(SameOrigin, allowed={h.lower() for h in door.allowed_host})] if credentials is None else []",
        ("tests/test_shared_server.py", "-k", "with_a_login_the_api")),
    Bug("a checkpoints folder planted as a link followed", "src/tunebench/training/checkpoint.py",
        "    if run.checkpoints.is_symlink():", "    if False:",
        ("tests/test_durable.py", "-k", "planted_link_for_the_checkpoints")),
    Bug("a call past its limit left running in the environment's process", "src/tunebench/core/userprocess.py",
        "            if not conn.poll(limit_s):\n                self.restart()\n                return None",
        "            if not conn.poll(limit_s):\n                return None",
        ("tests/test_environment_process.py", "-k", "sleeps_past or c_call")),
    Bug("the environment's process outliving a killed trainer", "src/tunebench/core/userprocess.py",
        "    startup.die_with_parent(int(parent), signal.SIGKILL)", "    pass",
        ("tests/test_environment_process.py", "-k", "dies_with")),
    Bug("the output folder's write test written through a link", "src/tunebench/training/checkpoint.py",
        '        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")\n        os.close(fd)',
        '        probe = path / ".write-test"\n        probe.write_text("ok")',
        ("tests/test_durable.py", "-k", "write_test_and_the_runs_report")),
    Bug("a run's linked report folder followed", "src/tunebench/jobs/run_report.py",
        "    if not out_dir and out.is_symlink():", "    if False:",
        ("tests/test_durable.py", "-k", "write_test_and_the_runs_report")),
    Bug("a tool call naming limit_s reaches within()'s own parameter", "src/tunebench/core/userprocess.py",
        "    def within(self, limit_s: float, /, *args, **kwargs)", "    def within(self, limit_s: float, *args, **kwargs)",
        ("tests/test_environment_process.py", "-k", "tool_that_raises_sleeps")),
    Bug("a child run imports Python from the server's folder first", "src/tunebench/jobs/children.py",
        '[sys.executable, *SAFE_PATH, "-m", "tunebench", *launch, job]',
        '[sys.executable, "-m", "tunebench", *launch, job]', ("tests/test_robustness.py", "-k", "planted_tunebench")),
    Bug("what a tool started outlives the environment's process", "src/tunebench/core/userprocess.py",
        "            os.killpg(proc.pid, signal.SIGKILL)", "            proc.kill()",
        ("tests/test_environment_process.py", "-k", "what_a_tool_starts")),
    Bug("Ctrl-C ignored in every program a tool starts", "src/tunebench/core/userprocess.py",
        "    signal.signal(signal.SIGINT, lambda *_: None)", "    signal.signal(signal.SIGINT, signal.SIG_IGN)",
        ("tests/test_environment_process.py", "-k", "what_a_tool_starts")),
    Bug("what a tool started outlives a trainer killed with -9", "src/tunebench/core/userprocess.py",
        "    _sentinel(int(fd))\n", "", ("tests/test_environment_process.py", "-k", "killed_with_sigkill")),
    # round five's fixes (issue 83) that had no row (issue 98)
    Bug("a one-machine launch's store on every interface (M1)", "src/tunebench/jobs/launch.py",
        "        with loopback_stores() if not rdzv_endpoint else contextlib.nullcontext():",
        "        with contextlib.nullcontext():",
        ("tests/test_distributed.py", "-k", "loopback_alone")),
    Bug("the model cap skipped while a generation runs", "src/tunebench/interfaces/web/models.py",
        "            self._evict(keep=MAX_LOADED - 1)",
        "            self._evict(keep=MAX_LOADED - 1) if self.in_use is None else None",
        ("tests/test_serve.py", "-k", "model_cap_holds")),
    Bug("the studio's processes unchecked against its cores", "src/tunebench/interfaces/web/studio.py",
        "    if ask.processes > cores:", "    if False:",
        ("tests/test_studio.py", "-k", "two_processes")),
    Bug("a tool call nested past the recursion limit raising", "src/tunebench/data/toolcalls.py",
        "        except (json.JSONDecodeError, RecursionError):", "        except json.JSONDecodeError:",
        ("tests/test_data.py", "-k", "reply_in_the_tool_template")),
    Bug("a schema's patterns timed each on its own, not per call", "src/tunebench/data/toolcalls.py",
        "        left = min(PATTERN_TIMEOUT_S, deadline - time.monotonic())", "        left = PATTERN_TIMEOUT_S",
        ("tests/test_quality.py", "-k", "patterns_end")),
    Bug("reset and reward waited for without a limit", "src/tunebench/training/grpo/environment.py",
        "    box = remote.within(CALLBACK_S, *args)", "    box = remote.within(3600.0, *args)",
        ("tests/test_environment_process.py", "-k", "never_answers")),
    Bug("a torch whose weights_only load can run code allowed (CVE-2025-32434)", "pyproject.toml",
        '    "torch>=2.6",', '    "torch>=2.4",',
        ("tests/test_layers.py", "-k", "older_than_2_6")),
    Bug("a kept upload readable by everyone (the default umask)", "src/tunebench/interfaces/web/studio.py",
        "os.O_EXCL | os.O_NOFOLLOW, 0o600)", "os.O_EXCL | os.O_NOFOLLOW, 0o666)",
        ("tests/test_studio.py", "-k", "upload_while_a_run_is_queued")),
    Bug("each rank's gloo listener on the host name's address", "src/tunebench/jobs/launch.py",
        '        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())', "        pass",
        ("tests/test_distributed.py", "-k", "loopback_alone")),
    Bug("an API request's tool calls uncounted", "src/tunebench/interfaces/web/openai_api.py",
        "    if calls > MAX_TOOL_CALLS:", "    if False:",
        ("tests/test_openai_api.py", "-k", "bad_requests_get")),
    Bug("a tool's answer sent whole", "src/tunebench/core/userprocess.py",
        '                if name not in ("reset", "reward") and len(value) > MAX_ANSWER:',
        "                if False:", ("tests/test_environment_process.py", "-k", "long_answer_is_cut")),
    Bug("the step's seed waited for without a limit", "src/tunebench/core/userprocess.py",
        '        if self.ask(("seed", seed), limit_s) is None:', '        if self.ask(("seed", seed), None) is None:',
        ("tests/test_environment_process.py", "-k", "long_answer_is_cut")),
    Bug("a resume with no checkpoint runs unchecked user files", "src/tunebench/training/checkpoint.py",
        "    if not resume or not record.is_file():", "    if True:",
        ("tests/test_durable.py", "-k", "first_start_recorded")),
    Bug("the environment's process imports Python from the current folder first", "src/tunebench/core/userprocess.py",
        '[sys.executable, *SAFE_PATH, "-c",', '[sys.executable, "-c",',
        ("tests/test_environment_process.py", "-k", "long_answer_is_cut")),
    Bug("a turn's calls uncapped", "src/tunebench/training/grpo/episodes.py",
        'result = environment_.call(e.env, c["name"], c["arguments"]) if i < MAX_CALLS else',
        'result = environment_.call(e.env, c["name"], c["arguments"]) if True else',
        ("tests/test_episodes.py", "-k", "max_calls"), deadline_s=240.0),
    Bug("the environment's restarts in a step uncounted", "src/tunebench/training/grpo/episodes.py",
        "        if restarts > MAX_RESTARTS:", "        if False:",
        ("tests/test_episodes.py", "-k", "max_calls"), deadline_s=240.0),
    Bug("a format: reward's pattern without a time limit", "src/tunebench/training/grpo/rewards.py",
        "        return pattern.search(text, timeout=PATTERN_S) is not None", "        return pattern.search(text) is not None",
        ("tests/test_grpo.py", "-k", "process_of_its_own"), deadline_s=240.0),
    Bug("a --reward function waited for without a limit", "src/tunebench/training/grpo/rewards.py",
        "        box = fn.within(CALL_S, prompts=", "        box = fn.within(None, prompts=",
        ("tests/test_grpo.py", "-k", "process_of_its_own"), deadline_s=240.0),
    Bug("additionalProperties matches patternProperties' keys with re, unbounded", "src/tunebench/data/toolcalls.py",
        '                                              "additionalProperties": additional_properties})', "})",
        ("tests/test_quality.py", "-k", "patterns_end"), deadline_s=120.0),
    Bug("unevaluatedProperties beside patternProperties let through", "src/tunebench/data/toolcalls.py",
        "    if _unbounded_patterns(schema):", "    if False:",
        ("tests/test_quality.py", "-k", "patterns_end"), deadline_s=120.0),
    Bug("a run whose cores others took teaches the next run its speed (issue 95)", "src/tunebench/jobs/parts/recipe.py",
        "    if m.key and not plancheck.shared_too_much(check):", "    if m.key:",
        ("tests/test_plancheck.py", "-k", "run_prints"), deadline_s=300.0),
    Bug("a child run starts in the folder the server was started from (issue 98 N1)", "src/tunebench/jobs/children.py",
        "text=True, cwd=run_dir,", "text=True,", ("tests/test_robustness.py", "-k", "starts_in_its_run_folder"),
        deadline_s=120.0),
    Bug("a child run's relative paths handed on as given (issue 98 N1)", "src/tunebench/jobs/children.py",
        "write_config(runpaths.with_absolute_paths(cfg, here), asked)", "write_config(cfg, asked)",
        ("tests/test_robustness.py", "-k", "starts_in_its_run_folder"), deadline_s=120.0),
    Bug("the probe's ratio pooled over every micro batch (issue 95)", "src/tunebench/training/plancheck.py",
        "    if at_micro:", "    if False:", ("tests/test_plancheck.py", "-k", "ratio_is_taken"), deadline_s=120.0),
    Bug("a compiled run planned at eager's activations (issue 95)", "src/tunebench/training/autotune/memory.py",
        "    plan = when_compiled(plan, device_type) if compiled else plan", "",
        ("tests/test_memory_plan.py", "-k", "compiled"), deadline_s=120.0),
    Bug("a draw's later updates at a ratio of 1 (issue 96)", "src/tunebench/training/grpo/steps.py",
        '            batch["old_logps"] = groups.old_logps[tuple(keys)]', "            pass",
        ("tests/test_grpo.py", "-k", "num_iterations_steps"), deadline_s=120.0),
)


def run(tests: tuple[str, ...], deadline_s: float) -> tuple[int | None, float]:
    """(pytest's exit code, or None when it ran past `deadline_s` and was killed with all it started; seconds)."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *tests],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        code = proc.wait(deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    return code, time.monotonic() - started


def main(argv: list[str]) -> int:
    chosen = [b for b in BUGS if not argv or b.name in argv or argv == ["--list"]]
    if argv == ["--list"]:
        for b in chosen:
            print(f"{b.name}: {b.path}; {' '.join(b.tests)}")
        return 0
    baseline: dict[tuple[str, ...], int] = {}
    rows = []
    for b in chosen:
        path = ROOT / b.path
        text = path.read_text(encoding="utf-8")
        if text.count(b.old) != 1:
            rows.append((b.name, "not planted: the line is not in the file once", 0.0))
            continue
        if b.tests not in baseline:
            baseline[b.tests] = run(b.tests, b.deadline_s)[0]
        if baseline[b.tests] != 0:
            rows.append((b.name, f"tests fail unpatched (exit {baseline[b.tests]})", 0.0))
            continue
        try:
            path.write_text(text.replace(b.old, b.new), encoding="utf-8")
            code, seconds = run(b.tests, b.deadline_s)
        finally:
            path.write_text(text, encoding="utf-8")
        rows.append((b.name, "caught" if code == 1 else f"HUNG (stopped at {b.deadline_s:.0f} s)" if code is None
                     else f"MISSED (exit {code})", seconds))
        print(f"{rows[-1][1]:>10}  {b.name} ({seconds:.0f} s)", flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'planted bug'.ljust(width)}  result  seconds")
    for name, result, seconds in rows:
        print(f"{name.ljust(width)}  {result}  {seconds:.0f}")
    return 0 if all(r[1] == "caught" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
