"""The package's shape: no import circle, and the modules that must load without torch do."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "tunebench"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes under `if TYPE_CHECKING:` (read by type checkers only, never run)."""
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            hidden |= {id(n) for n in ast.walk(node)}
    return hidden


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, at the top or inside a function alike: an import hidden in
    a function still ties the two modules together, it only hides the circle until run time."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        hidden = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]  # `from pkg import module`
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target not in (name, "tunebench"):
                    found.add(target)
        graph[name] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return groups


def test_the_walk_sees_imports_inside_functions_and_finds_a_circle():
    graph = import_graph()
    assert "tunebench.training.autotune.compiler" in graph["tunebench.training.runplan"]  # imported inside runplan.measure
    assert "tunebench.jobs.finetune" in graph["tunebench.interfaces.cli"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_has_no_import_circle():
    found = circles(import_graph())
    assert not found, "import circles (a lower module imports a higher one): " + "; ".join(
        " <-> ".join(g) for g in found)


# What a function may import for itself: the libraries whose import costs seconds or may be absent (torch and what
# builds on it, the web, tracking, quantization and evaluation stacks), and the package's modules that import one at
# their top, where the importing module does not already; then a command pays for them only when it uses them. Every
# other import sits at its file's top, where a reader sees what the file depends on. Two files are lazy by design:
# the package's root (its API loads when named) and the command line's dispatch (each job's module loads when the
# job is chosen, so `tunebench --help` and a refused flag never load the others).
HEAVY = ("torch", "transformers", "peft", "datasets", "accelerate", "bitsandbytes", "optuna", "matplotlib", "mlflow",
         "gradio", "llama_cpp", "lm_eval", "gguf", "sacrebleu", "rouge_score", "pyarrow", "sqlalchemy", "safetensors",
         "tokenizers", "trl", "liger_kernel", "fastapi", "uvicorn", "starlette", "psycopg", "tensorboard", "wandb",
         "aim", "pynvml", "nvidia_smi", "pandas", "numpy", "openai", "playwright", "huggingface_hub")
LAZY_BY_DESIGN = ("tunebench", "tunebench.interfaces.cli")


def _top_imports() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, list[tuple[str, int, bool]]]]:
    """Per module: the package's modules and the HEAVY libraries it imports at its top, and each import inside one
    of its functions (the module or library, the line, whether it is the package's)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    top: dict[str, set[str]] = {n: set() for n in files}
    libraries: dict[str, set[str]] = {n: set() for n in files}
    inner: dict[str, list[tuple[str, int, bool]]] = {n: [] for n in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        hidden = _type_checking_nodes(tree)
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f)}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in hidden or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                ours = target.split(".")[0] == "tunebench"
                while ours and target not in files:
                    target = target.rpartition(".")[0]
                if id(node) in in_function:
                    inner[name].append((target, node.lineno, ours))
                elif ours:
                    top[name].add(target)
                elif target.split(".")[0] in HEAVY:
                    libraries[name].add(target.split(".")[0])
    return top, libraries, inner


def test_imports_sit_at_a_files_top_unless_they_load_a_heavy_library():
    top, libraries, inner = _top_imports()
    loads: dict[str, set[str]] = {}

    def heavy(module: str, seen: frozenset = frozenset()) -> set[str]:
        if module not in loads:
            found = set(libraries[module])
            for other in top[module] - seen - {module}:
                found |= heavy(other, seen | {module})
            if not seen:
                loads[module] = found
            return found
        return loads[module]

    wrong = [f"{module}:{line} imports {target} inside a function" for module, found in inner.items()
             if module not in LAZY_BY_DESIGN for target, line, ours in found
             if not ((heavy(target) - heavy(module)) if ours else target.split(".")[0] in HEAVY
                     or target.split(".")[0] not in sys.stdlib_module_names)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("module", ["tunebench.jobs.report", "tunebench.interfaces.cli_parser", "tunebench.model.quality"])
def test_modules_that_need_no_torch_load_without_it(module):
    """The report renders a CSV written anywhere; the parser refuses bad options before torch loads; the task
    metrics' names are read by both."""
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} loads {done.stdout.strip()}"


def test_every_job_the_parser_knows_is_in_the_cli_table():
    import argparse

    from tunebench.interfaces import cli
    from tunebench.interfaces.cli_parser import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(cli.JOBS)


# The package's folders from the bottom up: the tree is the architecture diagram, and each folder imports only
# from itself and the folders below it (an import inside a function counts).
FOLDERS = ("core", "machine", "settings", "data", "model", "training", "jobs", "interfaces")


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    def folder(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else None

    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if folder(m) and folder(d) and FOLDERS.index(folder(d)) > FOLDERS.index(folder(m)))


def test_each_folder_imports_only_from_the_folders_below_it():
    assert upward_imports({"tunebench.data.x": {"tunebench.model.y"}}) == ["tunebench.data.x -> tunebench.model.y"]
    found = upward_imports(import_graph())
    assert not found, "a lower folder imports a higher one: " + "; ".join(found)


def test_every_module_lives_in_a_layer_folder():
    beside = sorted(p.name for p in PACKAGE.glob("*.py")) + sorted(
        p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file() and p.name not in FOLDERS)
    assert beside == ["__init__.py", "__main__.py"], beside


def private_imports(source: str) -> list[str]:
    """`from tunebench.x import _name` and `module._name` where `module` was imported from the package: a name
    another module keeps to itself, reached from outside it."""
    tree = ast.parse(source)
    modules: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tunebench"):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"from {node.module} import {a.name}")
                modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name.startswith("tunebench")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and node.attr.startswith("_") and not node.attr.startswith("__"):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    assert private_imports("from tunebench.jobs.report import _png\nfrom tunebench.model import models\n"
                           "models._tiny()\nmodels.tiny()\nself._x\n") == ["from tunebench.jobs.report import _png",
                                                                           "models._tiny"]
    found = {str(p.relative_to(PACKAGE)): hits for p in PACKAGE.rglob("*.py") if (hits := private_imports(p.read_text()))}
    assert not found, found


# The training jobs are recipes over jobs/parts/recipe.py: none builds on another or on any other job (what they share
# lives in jobs/parts: finetune_model, finetune_data, finetune_report, pretraining and grpo_run, which import no job;
# the run report is only handed to the runner as the run's end), and each reads in order, one argument a line.
RECIPES = ("tunebench.jobs.finetune", "tunebench.jobs.grpo", "tunebench.jobs.pretrain")
PARTS = "tunebench.jobs.parts"
PARTS_DIR = PACKAGE / "jobs" / "parts"


def test_no_training_recipe_imports_another_job():
    graph = import_graph()
    found = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                   if (d in RECIPES and m.startswith("tunebench.jobs."))
                   or (m in RECIPES and d.startswith("tunebench.jobs.") and d != "tunebench.jobs.run_report"
                       and not d.startswith(PARTS))
                   or (m.startswith(PARTS) and d.startswith("tunebench.jobs.") and not d.startswith(PARTS)))
    assert not found, found


def test_training_takes_the_parts_of_a_run_it_reads_never_a_jobs_whole_configuration():
    """Issue 97: what reads a run's configuration (the per-job glue: finetune's model, data and report,
    pretraining's, GRPO's; and the spine every job shares: recipe, runner, measuring) lives in jobs/parts; no module
    under training/ imports a job's configuration type (settings.finetune's RunConfig, settings.pretrain's
    PretrainRun) or the sections every run shares (settings.schema's RunBase), and no training/ function takes a
    `cfg`. Before: 43 functions in 8 training/ files took one; 11 in recipe, runner and measuring after the glue moved."""
    whole = {"RunBase", "RunConfig", "PretrainRun"}
    found = []
    for path in (PACKAGE / "training").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tunebench.settings"):
                if node.module in ("tunebench.settings.finetune", "tunebench.settings.pretrain") or \
                        whole & {a.name for a in node.names}:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} imports from {node.module}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(a.arg == "cfg" for a in node.args.args + node.args.kwonlyargs):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} takes cfg")
    assert not found, found


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_training_recipe_is_one_short_file(recipe):
    lines = (PACKAGE.parent / (recipe.replace(".", "/") + ".py")).read_text().splitlines()
    # One argument a line in the Recipe a job hands over reads better than packed lines: about 100 lines a recipe.
    assert len(lines) <= 100, f"{recipe}: {len(lines)} lines; move what is not the recipe's own order below the jobs"


def test_no_module_inside_the_package_imports_its_root():
    """The root (tunebench/__init__.py) imports down: the version and start-up from core, the Python API on first
    use. A module that imports the root back runs up past every layer (and the walk above cannot see it: the root
    is no layer's)."""
    back = []
    for path in PACKAGE.rglob("*.py"):
        if path == PACKAGE / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import) and any(a.name == "tunebench" for a in node.names) or \
                    isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "tunebench":
                back.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not back, "imports the package root: " + ", ".join(back)


def test_the_packages_version_is_pyprojects():
    import tomllib

    import tunebench
    from tunebench.core import VERSION

    project = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())["project"]
    assert tunebench.__version__ == VERSION == project["version"]


def _calls(path: Path, function: str) -> set[str]:
    """The dotted names `function` in `path` calls (`recipe.run`, `loop.optimizer_steps`, `x.backward`)."""
    tree = ast.parse(path.read_text())
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {ast.unparse(n.func) for n in ast.walk(body) if isinstance(n, ast.Call)}


def test_a_reader_reaches_the_backward_pass_in_two_hops_from_each_job():
    """Each training job's run hands its Recipe to recipe.run (hop one), which reads as its named stages (plan_run,
    build_trainer, the optimizer steps inside `training`'s set-up and end, finish) and calls the optimizer steps
    itself (hop two), whose body runs the backward pass: a layer added in between fails here."""
    for job in ("finetune", "grpo", "pretrain"):
        assert "recipe.run" in _calls(PACKAGE / "jobs" / f"{job}.py", "run"), job
    assert {"plan_run", "build_trainer", "training", "loop.optimizer_steps", "finish"} <= \
        _calls(PARTS_DIR / "recipe.py", "run")
    assert any(c.endswith(".backward") for c in _calls(PACKAGE / "training" / "loop.py", "optimizer_steps"))


def _method_calls(path: Path, cls: str, method: str) -> set[str]:
    tree = ast.parse(path.read_text())
    owner = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    body = next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == method)
    return {ast.unparse(n.func) for n in ast.walk(body) if isinstance(n, ast.Call)}


def test_the_step_is_a_stage_the_loop_asks_for_whole():
    """Issue 97 item 3: the loop asks a step source for a whole optimizer step's micro batches (feed.Steps). Rows are
    cut by feed.RowSteps, which calls back into no job; GRPO's step (grpo/steps.py's DrawnSteps) draws, groups and
    has RowSteps cut the groups it hands on: collate reads no step state stored earlier. The step takes a draw's
    stages itself (seeded, play, scored): an environment's play is the episode loop, whose turn is a decode with
    each episode's cache (decoding.Turns), and a completion's play is one decode. The loop has no switch of GRPO's: whether steps are made ahead is the source's `sampled`.
    (tests/test_episodes.py runs a GRPO and an SFT run and counts the frames.)"""
    training = PACKAGE / "training"
    assert _method_calls(training / "feed.py", "RowSteps", "next") <= {
        "self.at_step", "batching.micro_steps", "distributed.shard", "self.collate", "self._filler", "batches.append"}
    assert {"self.rows.at_step", "self.rows.share", "draws.seeded", "draws.play", "draws.scored", "refill",
            "step_seed", "self.step_rows.groups_of", "self.rows.next"} <= _method_calls(training / "grpo" / "steps.py",
                                                                                        "DrawnSteps", "next")
    assert {"turns.decode", "decoding.decode"} <= _method_calls(training / "grpo" / "episodes.py", "Episodes", "play")
    assert "decoding.decode" in _method_calls(training / "grpo" / "__init__.py", "Completions", "play")
    collate = _method_calls(training / "grpo" / "steps.py", "StepRows", "collate")
    assert collate <= {"self.filler", "rows_of", "self.old_logps", "tuple"}, collate
    assert "self.groups" not in (training / "grpo" / "steps.py").read_text()  # the step's groups are an argument
    names = {getattr(n, "id", None) or getattr(n, "attr", None) or getattr(n, "name", None) or getattr(n, "arg", "")
             for n in ast.walk(ast.parse((training / "loop.py").read_text()))}
    grpo = [n for n in names if n and re.search(r"grpo|rollout|draw|begin_step", n.lower())]
    assert not grpo, f"the loop names a GRPO part: {grpo}"


def test_only_the_settings_loader_and_the_preference_slice_test_an_objectives_name():
    """The code around an objective reads its typed settings' facts (data, unit, samples, preference, report,
    reference_forwards, charts), never its name: a string test of 'sft', 'dpo', 'orpo', 'kto', 'grpo' or 'rft' (a
    comparison, a dict key or a subscript), or a key formatted from `objective.name` (an f-string that is not an
    error's or a printed message), is the settings loader's (settings/finetune.py, settings/objectives.py) or the
    preference slice's, which builds DPO's, ORPO's or KTO's loss (training/preference.py). Before the typed
    settings, 11 files did; issue 97 found the measurement key formatted as f"{method}+{objective.name}" (now the
    type's `measured_as`) and the report picking its charts by metric names (now the type's `charts`)."""
    names = {"sft", "dpo", "orpo", "kto", "grpo", "rft"}

    def named(node) -> bool:
        return isinstance(node, ast.Constant) and node.value in names or isinstance(
            node, (ast.Tuple, ast.List, ast.Set)) and any(named(e) for e in node.elts)

    testing = set()
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        said = {id(a) for n in ast.walk(tree) if isinstance(n, ast.Call) and (
            ast.unparse(n.func).endswith("Error") or ast.unparse(n.func) == "print") for a in n.args}
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and "loss_type" not in ast.unparse(node) and any(  # GRPO's "grpo" loss
                    named(c) for c in [node.left, *node.comparators]) \
                    or isinstance(node, ast.Dict) and any(named(k) for k in node.keys if k is not None) \
                    or isinstance(node, ast.Subscript) and named(node.slice) \
                    or isinstance(node, ast.JoinedStr) and id(node) not in said and any(
                        isinstance(v, ast.FormattedValue) and ast.unparse(v.value).endswith("objective.name")
                        for v in node.values):
                testing.add(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert {t.split(":")[0] for t in testing} <= {"settings/finetune.py", "settings/objectives.py",
                                                  "training/preference.py"}, testing


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}", node.args


def test_no_function_takes_more_than_twelve_parameters_and_every_cfg_is_typed():
    """A signature past 12 parameters is a missing type (evaluate.Placement, app.Served and app.Door, runplan.Units
    replaced four); a `cfg` without its annotation hides which run type it is from every reader."""
    wide, untyped = [], []
    for where, a in _functions():
        names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
        n = len(names) - (names[:1] in (["self"], ["cls"]))
        if n > 12:
            wide.append(f"{where} ({n})")
        untyped += [where for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg == "cfg" and x.annotation is None]
    assert not wide, f"more than 12 parameters: {wide}"
    assert not untyped, f"cfg without a type: {untyped}"


def test_a_recipe_holds_only_what_differs_between_objectives():
    """What every recipe would pass the same belongs to recipe.run; what the measurement and the plan count is
    runplan.Units, one field. At most 18 fields, and no run type made at run time."""
    import dataclasses

    from tunebench.jobs.parts import recipe

    assert len(dataclasses.fields(recipe.Recipe)) <= 18, [f.name for f in dataclasses.fields(recipe.Recipe)]
    # the one exception is not a run type: the objective section users spell, made once at import from the
    # objectives' types so that each setting is declared once (settings.objectives.flat_section; issue 97)
    made = [p.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py") if "make_dataclass" in p.read_text()
            and p != PACKAGE / "settings" / "objectives.py"]
    assert not made, made


def test_no_two_classes_share_a_name():
    """A class name says which one it is (Hardware the machine, HardwareConfig the section asked for). The
    exceptions: the pretraining API's ModelConfig and DataConfig, spelled as the CPU framework's documents spell
    them, beside the fine-tuning sections of the same names in their own settings module."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    twice = {name: where for name, where in seen.items() if len(where) > 1}
    assert set(twice) <= {"ModelConfig", "DataConfig"}, twice
    assert all(sorted(w) == ["settings/finetune.py", "settings/pretrain.py"] for w in twice.values()), twice


def test_the_loop_reads_each_objective_through_its_written_protocol(tiny):
    """objective.Objective names what the loop and evaluation ask of an objective (its unit, stats, their means): each
    objective has all of it, and the loop probes none of it with getattr or hasattr."""
    from tunebench.settings.objectives import GRPO
    from tunebench.training import grpo, preference
    from tunebench.training.objective import CausalLMLoss, Objective

    settings = GRPO(num_generations=2, max_completion_length=8, loss_type="dapo")
    objectives = [CausalLMLoss(tiny.model), *(preference.PreferenceLoss(tiny.model, m, 0.1)
                                              for m in ("dpo", "orpo", "kto")),
                  grpo.GRPOLoss(tiny.model, settings, [])]
    for objective in objectives:
        assert isinstance(objective, Objective), type(objective).__name__
        assert objective.stat_finish({"x": 1.0}, 2) == {"x": 1.0} or isinstance(objective, grpo.GRPOLoss)
    # the loop and the evaluation and stat means it calls (training/objective.py since the loop's file split)
    source = "".join((PACKAGE / "training" / f).read_text() for f in ("loop.py", "objective.py"))
    assert not re.search(r"(getattr|hasattr)\([^)]*\"(stat_names|stat_per|stat_finish|unit)\"", source)


@pytest.mark.parametrize("version, refused", [("2.5.1+cu121", True), ("2.6.0", False), ("2.13.0+cpu", False)])
def test_a_torch_older_than_2_6_is_refused_by_the_set_up(tmp_path, version, refused):
    """torch.load(weights_only=True), which reads every checkpoint, can be made to run code before torch 2.6
    (CVE-2025-32434): pyproject asks for 2.6, and ./run refuses an older torch already in the venv (pip would
    replace it with PyPI's newest, a CUDA build on Linux) with its own check, run here on a stand-in torch."""
    import tomllib

    root = PACKAGE.parents[1]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.6" in deps
    check = re.search(r'-c "(import sys, torch;[^"]+)"', (root / "run").read_text()).group(1)
    (tmp_path / "torch.py").write_text(f"__version__ = {version!r}\n")
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert (done.returncode != 0) == refused


def test_every_planted_bug_of_the_mutation_table_is_still_planted_once():
    """tests/mutations.py runs by hand (it reruns parts of the suite once per bug); here, on every run, each bug's
    line is still in its file exactly once, so a refactor cannot quietly turn a row into "not planted"."""
    import mutations

    missing = [b.name for b in mutations.BUGS if (mutations.ROOT / b.path).read_text().count(b.old) != 1]
    assert not missing, missing


def test_no_function_in_the_package_runs_past_eighty_lines():
    """The package reads as named parts (recipe.run's stages, optimizer_steps' _feed/_update/_after_step, the batch
    probe's _gain/_best/_step_stop/_choose, a parser function per job, a function per web tab and its events): a
    function anywhere in src/ past 80 lines is one to split (issue 97: training/ alone held to it, build_parser had
    grown to 294 lines and the studio's add_tabs to 224)."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, long


def test_strict_mode_fails_a_whole_module_skipped_at_collection(tmp_path):
    """conftest's strict rule reaches a skip made while a module is collected (module-level skip, importorskip),
    which the per-test hook never sees: the run fails under TUNEBENCH_STRICT=1 and skips without it."""
    import os
    import subprocess
    import sys

    probe = tmp_path / "test_probe.py"
    probe.write_text('import pytest\n\npytest.skip("a reason nobody allowed", allow_module_level=True)\n')
    run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", str(probe)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    strict = subprocess.run(run, capture_output=True, text=True, env={**env, "TUNEBENCH_STRICT": "1"}, timeout=120)
    plain = subprocess.run(run, capture_output=True, text=True, env={k: v for k, v in env.items()
                                                                      if k != "TUNEBENCH_STRICT"}, timeout=120)
    assert strict.returncode != 0 and "skipped at collection under TUNEBENCH_STRICT=1" in strict.stdout
    assert plain.returncode in (0, 5) and "1 skipped" in plain.stdout  # 5: no test left to run
