"""`--compile auto`: compile the decoder blocks when measurement says it pays off over this run."""

from __future__ import annotations

import contextlib
import os
import re
import time

import torch

from tunebench.core import startup
from tunebench.core.decision import Decision
from tunebench.core.paths import cache_dir
from tunebench.training.autotune import Key, Shape, cached, store
from tunebench.training.autotune.budget import run_seconds

COMPILE_MEASURE_MIN_S = 180.0  # measuring costs a first compile and ~25 probe steps: ~1 min on 2 cores
# What measuring compile costs beyond its probes (a first compile, a second from the compiler's disk cache) before
# this machine has been seen doing it; afterwards what the last measurement took beyond its probes, per machine.
MEASURE_GUESS_S = {"cpu": 90.0, "cuda": 60.0}
# The probe calls measuring compile makes: two warm-ups of two each (warm_up_compiled), then eager and compiled
# in two rounds (eager_vs_compiled). Each costs what one probe call at this micro batch took: a GRPO arm's
# (4 rows x 1,024 tokens with a reference pass, ~110 s a call on 2 cores) was still measuring compile after ~10
# minutes (its 8 probe calls alone ~15) against a 270 s budget: its cost was read as the 90 s first guess, which
# a small model's compile and probes take (2026-12-03).
PROBES = 8


def measuring_cost(where: str, probe_s: float | None = None) -> tuple[float, str]:
    """(seconds measuring compile is expected to take on `where`, how that is known): the compiling, as it took
    here last time beyond its probes (a first guess before), and PROBES probe calls of `probe_s` seconds each,
    what one took at the run's micro batch (None: not timed, the compiling alone)."""
    seen = cached(Key("compile-measuring", {"where": where}))
    if seen:
        compiling = max(0.0, seen["seconds"] - PROBES * seen.get("probe_s", 0.0))
        known = "as it took here last time"
    else:
        compiling = MEASURE_GUESS_S["cpu" if re.search(r" x\d+$", where) else "cuda"]  # tune.where: "<CPU> x<threads>"
        known = "a first guess on a machine not seen compiling"
    if not probe_s:
        return compiling, f"~{compiling:.0f} s, {known}"
    cost = compiling + PROBES * probe_s
    return cost, f"~{cost:.0f} s: compiling ~{compiling:.0f} s, {known}, and {PROBES} probes of {probe_s:.1f} s"


def eagerly(compiled: bool):
    """Run a compiled model eagerly for what is not the training step (evaluation, sampling): a compiled
    no-grad graph would cost a second warm-up for a few batches."""
    return torch.compiler.set_stance("force_eager") if compiled else contextlib.nullcontext()


def warm_up_compiled(model, measure, mode: str = "default") -> float:
    """Compile the blocks and run the first (compiling) probe; return its seconds beyond a steady probe's."""
    compile_blocks(model, mode)
    t0 = time.perf_counter()
    measure()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    measure()
    return max(0.0, first - (time.perf_counter() - t0))


def eager_vs_compiled(measure, rounds: int = 2) -> tuple[float, float]:
    """Best (eager, compiled) tokens/s of the compiled model, measured in alternation so that a
    shared machine's drift slows both alike (separate timings once showed a gain that was not there)."""
    eager, compiled = [], []
    for _ in range(rounds):
        with torch.compiler.set_stance("force_eager"):
            eager.append(measure())
        compiled.append(measure())
    return max(eager), max(compiled)


def compiles(model, measure, mode: str) -> str | None:
    """Compile the blocks and run one probe through them; None when that works, else why it did not
    (the model is left eager). A compiler failure (a missing C compiler, an unsupported op: the
    guide's "Compilation failed") costs the run its speed-up, not the run."""
    try:
        compile_blocks(model, mode)
        measure()
        return None
    except Exception as e:  # noqa: BLE001 - torch._dynamo and inductor raise many types; all mean "no compile"
        return _undo(model, e)


def _undo(model, e: Exception) -> str:
    """Back to eager after a failed compile; why it failed, in one line."""
    uncompile_blocks(model)
    torch._dynamo.reset()
    first = (str(e).strip().splitlines() or [""])[0][:160]
    return f"{type(e).__name__}: {first}"


def pick(model, asked: Decision, quantized: bool, measure, run_tokens: float, shape: Shape,
         micro_batch_size: int, eager_speed: float | None = None, mode: str = "default", budget=None,
         cap_s: float | None = None, probe_s: float | None = None) -> Decision:
    """Compile the decoder blocks when asked, or (`auto`) when measurement says it pays off in this run.

    The first long-enough run on a machine measures eager vs compiled tokens/s and the warm-up,
    and caches them; later runs compile only if the time saved over the run beats the warm-up
    with the compiler's disk cache warm. `eager_speed`, when the batch probe already timed this
    micro batch, spares a probe for the run-length estimate. `budget` (tune.budget.Budget): measuring is
    skipped when its expected cost would take the run's measuring past its share of the training time (`probe_s`:
    the seconds one probe call at this micro batch took, which measuring compile makes PROBES of). `cap_s`: the
    run's --time-budget, the longest it trains whatever its tokens.
    """
    if asked.value != "auto":
        if asked.value:
            failed = compiles(model, measure, mode)
            if failed:
                return Decision("compile", False, f"{asked.reason}, but compiling failed ({failed}): running eagerly")
        return Decision("compile", asked.value, asked.reason + ("" if mode == "default" or not asked.value
                                                          else f", mode {mode}"))
    if quantized:
        return Decision("compile", False, "bitsandbytes layers break the compiled graph; --compile on to try")
    key = shape.key("compile", micro_batch_size=micro_batch_size, **({"mode": mode} if mode != "default" else {}))
    hit = cached(key)
    if hit is None:
        run_s = run_seconds(run_tokens, eager_speed or measure(), cap_s)
        if run_s < COMPILE_MEASURE_MIN_S:
            return Decision("compile", False, f"not measured: this run (~{run_s:.0f} s) is too short to win back a first "
                                      "compile; --compile on to force")
        cost, known = measuring_cost(shape.where, probe_s)
        if budget is not None:
            budget.saw(eager_speed)
            if not budget.affords(cost):
                return Decision("compile", False, f"{budget.why_not(cost)} (measuring compile: {known}); --compile on "
                                          "to force")
        began = time.perf_counter()
        try:
            cold = warm_up_compiled(model, measure, mode)
            torch._dynamo.reset()  # again, from the compiler's disk cache: the warm-up later runs pay
            warm = warm_up_compiled(model, measure, mode)
        except Exception as e:  # noqa: BLE001 - a failed compile: see compiles()
            return Decision("compile", False, f"compiling failed ({_undo(model, e)}): running eagerly")
        eager, compiled = eager_vs_compiled(measure)
        hit = {"eager": eager, "compiled": compiled, "warmup_s": round(warm, 1)}
        store(key, hit)
        store(Key("compile-measuring", {"where": shape.where}),
              {"seconds": round(time.perf_counter() - began, 1), **({"probe_s": round(probe_s, 2)} if probe_s else {})})
        measured = (f"measured {compiled:,.0f} vs {eager:,.0f} tokens/s eager, alternating; warm-up {cold:.0f} s, "
                    f"{warm:.0f} s from cache")
        if compiled > 1.03 * eager:
            return Decision("compile", True, measured)
        uncompile_blocks(model)
        return Decision("compile", False, measured + ": no gain")
    eager, compiled, warm = hit["eager"], hit["compiled"], hit["warmup_s"]
    run_s = run_seconds(run_tokens, eager, cap_s)
    saved = run_s * (1 - eager / compiled)
    measured = f"measured {compiled:,.0f} vs {eager:,.0f} tokens/s eager"
    if compiled <= 1.03 * eager:
        return Decision("compile", False, measured + ": no gain")
    if saved <= warm:
        return Decision("compile", False, f"{measured}: saves ~{saved:.0f} s of this ~{run_s:.0f} s run, "
                                  f"less than its {warm:.0f} s warm-up")
    try:
        warm = warm_up_compiled(model, measure, mode)
    except Exception as e:  # noqa: BLE001 - a failed compile: see compiles()
        return Decision("compile", False, f"compiling failed ({_undo(model, e)}): running eagerly")
    store(key, dict(hit, warmup_s=round(warm, 1)))
    return Decision("compile", True, f"{measured}: saves ~{saved:.0f} s of this ~{run_s:.0f} s run for a {warm:.0f} s "
                             "warm-up")


def compile_blocks(model, mode: str = "default") -> int:
    """Compile each repeated block (the decoder layers) in place; return how many.

    Regional compilation: every layer runs one compiled graph, so the warm-up is that of one layer
    (seconds, or about 30 s on 2 CPU cores the first time) rather than minutes for the whole
    model, and parameter names, hence checkpoints, are unchanged. Shapes are dynamic, so
    length-grouped batches of any width reuse the graph.
    """
    # The compiler's own cache next to ours (not in /tmp, which a reboot may empty), so a later
    # run's warm-up is the short, cached one that pick has on record.
    if not startup.USER_INDUCTOR_CACHE:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    return _compile_repeated(model, None if mode == "default" else mode)


def _compile_repeated(model, mode: str | None) -> int:
    from accelerate.utils.other import is_repeated_blocks

    if is_repeated_blocks(model):
        for block in model:
            block.compile(dynamic=True, mode=mode)
        return len(model)
    return sum(_compile_repeated(child, mode) for child in model.children())


def uncompile_blocks(model) -> None:
    for m in model.modules():
        if getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None  # what nn.Module.compile set; the module runs eagerly again
