"""The documentation as a user meets it: the site builds in strict mode (a broken link or anchor fails), every
`tunebench` / `./run` command in the README and the docs parses with the parser the command runs, the data
formats' example rows are read as the format they claim, and the blocks marked `<!-- docs-test: run -->` (the
README's four commands and the CSV tutorial's) run exactly as written, on the default model."""

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import pairs_file, unavailable
from test_cli import tb_here

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN_MARK = "<!-- docs-test: run -->"
NOT_TUNEBENCH = {"test", "docs"}  # ./run's own commands, not tunebench jobs


def blocks(page: Path) -> list[tuple[bool, list[str]]]:
    """(marked to run, its command lines) of each bash block of a page; continued lines joined, comments cut."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"(<!-- docs-test: run -->\n)?```bash\n(.*?)```", text, re.S):
        joined = m.group(2).replace("\\\n", " ")
        lines = [shlex.split(line, comments=True) for line in joined.splitlines()]
        out.append((m.group(1) is not None, [" ".join(shlex.quote(w) for w in words) for words in lines if words]))
    return out


# A list item that is a command (the tutorials' "other forms"): `tunebench ...`, or `LABEL: tunebench ...`
LISTED = re.compile(r"^- (?:[\w ()]+: )?`((?:\./run|tunebench) [^`]+)`", re.M)


def listed_commands(page: Path) -> list[str]:
    """The commands a page lists one per item, outside its code blocks."""
    return LISTED.findall(re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S))


def tunebench_argv(line: str) -> list[str] | None:
    """The job's argv of a `./run JOB ...` or `tunebench JOB ...` line (after any VAR=value), else None."""
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]
    if len(words) < 2 or words[0] not in ("./run", "tunebench") or any(w in ("|", "&&", ";", "&") for w in words):
        return None
    return None if words[1] in NOT_TUNEBENCH else words[1:]


def test_the_site_builds_in_strict_mode(tmp_path):
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists():
        unavailable("MkDocs is not installed (it comes with the test extra: ./run test installs it)")
    proc = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    site = tmp_path / "site"
    assert (site / "tutorials" / "csv-to-ollama" / "index.html").is_file()
    config = (site / "reference" / "configuration" / "index.html").read_text()
    assert "optimizer.lr" in config and "adapter.lora_alpha" in config  # generated from the schema
    assert "tunebench export" in (site / "reference" / "cli" / "index.html").read_text()
    assert "Results on a GPU" in (site / "benchmarks" / "results" / "index.html").read_text()


def test_the_reference_pages_are_the_codes_own():
    """docs/reference/{configuration,cli,machines}.md are written from the code (python docs/hooks.py --write) and
    committed, so their links work in the repository view: each must be what the code makes now."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import hooks
    finally:
        sys.path.remove(str(ROOT / "docs"))
    stale = [uri for uri, text in hooks.generated().items()
             if " ".join((ROOT / "docs" / uri).read_text(encoding="utf-8").split()) != " ".join(text.split())]
    assert not stale, f"{stale} differ from the code: run `python docs/hooks.py --write` and commit them"


def test_every_relative_link_resolves_in_the_repository():
    """A reader of the repository (GitHub's view) follows the same links as the site's: each relative link of the
    README and the docs names a file that exists, from the page's own folder."""
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = target.split("#")[0]
            if not path or re.match(r"[a-z]+:", path):  # an anchor on the page, or a URL
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_design_page_names_every_module():
    """docs/DESIGN.md's layout names each module of the package (by its path, or its name in its folder's list)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    missing = [f.relative_to(ROOT / "src" / "tunebench").as_posix() for f in sorted((ROOT / "src" / "tunebench").rglob("*.py"))
               if f.name not in ("__init__.py", "__main__.py")
               and f.relative_to(ROOT / "src" / "tunebench").as_posix() not in text
               and not re.search(r"(?<![\w/.])" + re.escape(f.name) + r"\b", text)]
    assert not missing, f"docs/DESIGN.md does not name {missing}"


def test_the_run_directory_page_names_every_file_a_run_leaves(tmp_path, dataset):
    """Each file a training run leaves (with a tracker, so its files too) is a row of reference/run-directory.md."""
    from conftest import tiny_run_config
    from tunebench.jobs import finetune

    out = tmp_path / "run"
    finetune.run(tiny_run_config(dataset, out, **{"schedule.max_steps": 2, "logging.report_to": "tensorboard"}))
    page = (ROOT / "docs" / "reference" / "run-directory.md").read_text(encoding="utf-8")
    named = {n.rstrip("/").split("/")[0] for row in page.splitlines() if row.startswith("| ")
             for n in re.findall(r"`([^`]+)`", row.split(" | ")[0])}
    left = {p.name for p in out.iterdir()}
    assert left - named == set(), f"run-directory.md does not name {sorted(left - named)} (it names {sorted(named)})"


def documented_commands() -> list[tuple[str, str]]:
    """(page, line) of every `tunebench` / `./run` job command in the README and the docs."""
    return [(str(page.relative_to(ROOT)), line) for page in PAGES
            for line in [line for _, lines in blocks(page) for line in lines] + listed_commands(page)
            if tunebench_argv(line) is not None]


def parse_failures(commands: list[tuple[str, str]]) -> list[str]:
    """The commands the CLI would refuse before running, by cli.parse: argparse and the CLI's own rule for a
    word left over (an unknown flag is an error there, not an extra)."""
    from tunebench.core.errors import TunebenchError
    from tunebench.interfaces import cli

    failures = []
    for page, line in commands:
        try:
            cli.parse(tunebench_argv(line))
        except (TunebenchError, SystemExit) as e:
            failures.append(f"{page}: {line}: {e}")
    return failures


def test_every_documented_command_parses(capsys):
    commands = documented_commands()
    assert not parse_failures(commands), "\n".join(parse_failures(commands))
    assert len(commands) > 50, len(commands)  # the README, the tutorials and the guides hold this many at least


def test_a_wrong_flag_in_a_documented_command_is_caught(tmp_path, capsys):
    """The check above on a page with a mistyped flag, a stray word and a right command: the first two fail."""
    page = tmp_path / "page.md"
    page.write_text("```bash\n./run export runs/x --formats ollama   # a typo\ntunebench eval runs/x stray\n"
                    "tunebench export runs/x --format ollama\n```\n")
    lines = [("page.md", line) for _, found in blocks(page) for line in found]
    failures = parse_failures(lines)
    assert len(failures) == 2 and "--formats" in failures[0] and "stray" in failures[1], failures


def test_each_data_format_example_is_read_as_the_format_it_names():
    from tunebench.data import formats
    from tunebench.settings.finetune import DataConfig

    text = (ROOT / "docs" / "guides" / "data.md").read_text()
    rows = re.findall(r"^\| `(\w+)`[^|]*\|[^|]*\| `(\{.*\})` \|$", text, re.M)
    assert len(rows) >= 5, rows
    for fmt, example in rows:
        record = json.loads(example.replace("\\\\", "\\"))
        assert formats.detect(set(record), DataConfig()) == fmt, (fmt, record)
    tool_row = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    fmt, [conversation] = formats.records_to_messages([tool_row], DataConfig(), "data.md")
    assert fmt == "chat" and formats.carries_tools(conversation)
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool", "assistant"]


def _my_csv(path: Path, rows: int = 48) -> None:
    """A CSV as a user brings one: the built-in sample's first rows, two columns, a header."""
    sample = ROOT / "src" / "tunebench" / "data" / "sample" / "customer_support.jsonl"
    records = [json.loads(line) for line in sample.read_text().splitlines()[:rows]]
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["instruction", "response"])
        w.writerows([r["instruction"], r["response"]] for r in records)


def test_the_readme_and_the_csv_tutorial_run_as_written(tmp_path, monkeypatch, capsys, llama_cpp):
    """Every block marked to run, in page order: the README's four commands, then the tutorial's (the same
    run directory; the tutorial's train and export lines are the README's, run once), its `eval --gguf` with
    llama.cpp answering included. Ollama's own lines are the next test's; here the Modelfile they load, and the
    GGUF it names, are checked, with the line export printed."""

    monkeypatch.chdir(tmp_path)
    _my_csv(tmp_path / "my.csv")
    lines = [line for page in (ROOT / "README.md", ROOT / "docs" / "tutorials" / "csv-to-ollama.md")
             for run, block in blocks(page) if run for line in block]
    assert lines[:2] == ["./run train --data my.csv --output-dir runs/my-model",
                         "./run export runs/my-model --format ollama --quant q8_0 -o runs/my-model-ollama"]
    done, printed = set(), ""
    for line in lines:
        if line in done:
            continue
        done.add(line)
        argv = tunebench_argv(line)
        if argv is None:
            if line.startswith("ollama"):
                README_RUN.setdefault("ollama", []).append(line)
            continue
        proc = tb_here(*argv, check=False)
        printed += proc.stdout
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-3000:]}{proc.stderr[-1000:]}"
    modelfile = tmp_path / "runs" / "my-model-ollama" / "Modelfile"
    README_RUN["dir"] = tmp_path
    assert {"ollama create my-model -f runs/my-model-ollama/Modelfile", "ollama run my-model 'Where is my order?'"} \
        <= set(README_RUN.get("ollama", []))  # the next test's lines, found here whether or not Ollama is installed
    source = modelfile.read_text().splitlines()[0]
    assert source == "FROM ./my-model-q8_0.gguf" and (modelfile.parent / source[7:]).stat().st_size > 50e6
    readme = ROOT.joinpath("README.md").read_text()
    assert "ollama create my-model -f runs/my-model-ollama/Modelfile" in readme
    assert "ollama create my-model -f runs/my-model-ollama/Modelfile" in printed  # what export tells the user
    table = {line.split()[0]: line.split() for line in printed.splitlines() if line.split()[:1] in (
        ["model"], ["base"], ["my-model"])}
    assert {"model", "base", "my-model"} <= set(table) and "rougeL" in table["model"], printed[-3000:]


README_RUN: dict = {}  # what the test above ran and left: the next runs the README's Ollama lines on it
NO_OLLAMA = "ollama is not on PATH: it is neither on PyPI nor in Debian, so the test set-up cannot install it"


def test_the_readmes_ollama_lines_run_where_ollama_is(monkeypatch):
    """The README's `ollama create` and `ollama run`, on the export the test above made: run where Ollama is
    installed, reported as skipped (with the lines) where it is not, never passed over in silence."""
    if not shutil.which("ollama"):  # first: run alone, the skip is still the one strict mode allows
        pytest.skip(NO_OLLAMA)
    if "dir" not in README_RUN:
        pytest.fail("the README test (the line above this one in the file) made no export in this session: run the "
                    "two together", pytrace=False)
    monkeypatch.chdir(README_RUN["dir"])
    for line in README_RUN["ollama"]:
        subprocess.run(shlex.split(line), check=True, timeout=600)


def _corpus(tmp: Path) -> None:
    """A plain text file, as the pretraining tutorial asks a user to bring."""
    (tmp / "corpus.txt").write_text("".join(
        f"Line {i}: the quick brown fox jumps over the lazy dog, {i * 7 % 13} times, and rests.\n" for i in range(300)))


def _gsm8k(tmp: Path) -> None:
    """GSM8K-style problems in GSM8K's own format, as the GRPO tutorial asks."""
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
             "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(1, 5) for b in range(2, 7)]
    (tmp / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _votes(tmp: Path) -> None:
    """An A/B store as `serve` leaves it: votes recorded through the store serve writes with (ties and both-bad
    included), and thumbs on single answers (KTO's data)."""
    from tunebench.data import votes

    db = votes.open_store(tmp / "tunebench-ab.sqlite")
    settings = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 32}
    for i, vote in enumerate(("a", "b", "a", "tie", "b", "both_bad", "a", "b") * 2):
        votes.record(db, f"How do I cancel order {i}?", "run: runs/a (lora)", "run: runs/b (lora)",
                     f"Open Orders, pick order {i} and press Cancel.", "I cannot help with that.", vote, settings,
                     f"pair-{i}")
    for i in range(6):
        votes.record_feedback(db, [{"role": "user", "content": f"Where is my refund {i}?"}], "run: runs/a (lora)",
                              "It reaches your card in 5 days." if i % 2 else "No idea.", bool(i % 2), settings)


def _environment(tmp: Path) -> None:
    """The agents tutorial's env.py (with its stop rule's block added) and cart.py, the page's own Python blocks as
    written, and rows for each."""
    page = (ROOT / "docs" / "tutorials" / "agents.md").read_text(encoding="utf-8")
    env, cart, stop = re.findall(r"```python\n(.*?)```", page, re.S)
    (tmp / "env.py").write_text(env + "\n\n" + stop)
    (tmp / "cart.py").write_text(cart)
    rows = [{"question": f"What is under {k}?", "answer": v} for k, v in (("a", "1"), ("b", "2"), ("c", "3"))] * 3
    (tmp / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    carts = [{"item": item, "count": n} for item, n in (("pen", 2), ("cup", 1), ("ink", 3))] * 3
    (tmp / "carts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in carts))


def _pairs_and_prompts(tmp: Path) -> None:
    """The distributed tutorial's data: preference pairs for its DPO run (the DPO golden's six), GSM8K-style rows
    for its GRPO run."""
    pairs_file(tmp)
    _gsm8k(tmp)


# What each tutorial asks a user to bring (the README and the CSV tutorial have their own test above), and what its
# commands must have left behind
TUTORIALS = {
    "pretraining.md": (_corpus, ["tok/tokenizer.json", "runs/small/config.json", "runs/small-sft/adapter_config.json"]),
    "study.md": (None, ["runs/compare/results.csv", "runs/compare/report/report.html",
                        "runs/compare/report-again/report.md"]),
    "search.md": (None, ["runs/tune/study.sqlite", "runs/tune/results.csv", "runs/tune/best.yaml"]),
    "grpo.md": (_gsm8k, ["runs/grpo/adapter_config.json"]),
    "agents.md": (_environment, ["runs/agent/adapter_config.json", "runs/cart/adapter_config.json"]),
    "votes.md": (_votes, ["pairs.jsonl", "runs/dpo/adapter_config.json", "runs/dpo-from-file/adapter_config.json",
                          "runs/kto/adapter_config.json"]),
    "distributed.md": (_pairs_and_prompts, ["runs/ddp/adapter_config.json", "runs/ddp-dpo/adapter_config.json",
                                            "runs/ddp-grpo/adapter_config.json"]),
}


def test_every_tutorial_block_is_run_by_a_test():
    """A tutorial is a path a user takes end to end: each of its command blocks runs in a test (the CSV tutorial's
    in the README test above, the others' below)."""
    pages = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
    assert {p.name for p in pages} == {*TUTORIALS, "csv-to-ollama.md"}
    unmarked = [f"{p.name}: {lines}" for p in pages for run, lines in blocks(p) if not run]
    assert not unmarked, unmarked


@pytest.mark.usefixtures("children_in_process")
@pytest.mark.parametrize("page", sorted(TUTORIALS))
def test_each_tutorial_runs_as_written(page, tmp_path, monkeypatch):
    """A tutorial's first block, marked to run, end to end exactly as written, in a new directory holding only
    what the page asks a user to bring; each command reads what the one before it wrote. compare's and tune's
    one-process runs run in this process (their boundary is tested in test_compare_report and test_tune)."""

    setup, leaves = TUTORIALS[page]
    monkeypatch.chdir(tmp_path)
    if setup is not None:
        setup(tmp_path)
    lines = [line for run, block in blocks(ROOT / "docs" / "tutorials" / page) if run for line in block]
    assert lines, f"{page} has no block marked to run"
    for line in lines:
        argv = tunebench_argv(line)
        assert argv is not None, f"{page}: {line} is not a tunebench command"
        proc = tb_here(*argv, check=False)
        assert proc.returncode == 0, f"{page}: {line}\n{proc.stdout[-3000:]}{proc.stderr[-1000:]}"
    missing = [p for p in leaves if not (tmp_path / p).exists()]
    assert not missing, f"{page}: its commands left no {missing}"
    RAN_AS_SAID[page](tmp_path)  # what the page says its commands do, from what they wrote


def _summary(path: Path) -> dict:
    return json.loads(path.read_text())


def _csv_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# What each tutorial's walk-through says happens, checked on what its commands wrote (not only their exit codes)
RAN_AS_SAID = {
    "pretraining.md": lambda tmp: (
        _check(_summary(tmp / "runs" / "small" / "summary.json")["steps"] == 10, "pretraining: 10 steps"),
        _check(json.loads((tmp / "tok" / "tokenizer.json").read_text())["model"]["type"] == "BPE", "a BPE tokenizer"),
        _check(_summary(tmp / "runs" / "small-sft" / "summary.json")["steps"] == 4, "then 4 fine-tuning steps")),
    "study.md": lambda tmp: _check(
        {r["status"] for r in _csv_rows(tmp / "runs" / "compare" / "results.csv")} == {"ok"}
        and (tmp / "runs" / "compare" / "report-again" / "report.md").read_text().count("| ") > 0,
        "every experiment of the study ran, and the report was drawn again from its CSV"),
    # the second command finds the study and adds the third trial only
    "search.md": lambda tmp: _check(
        [r["experiment"] for r in _csv_rows(tmp / "runs" / "tune" / "results.csv")][:2] == ["trial-0", "trial-1"]
        and len(_csv_rows(tmp / "runs" / "tune" / "results.csv")) == 3,  # the third's number skips duplicates
        "two trials, then a third"),
    "grpo.md": lambda tmp: _check(_summary(tmp / "runs" / "grpo" / "summary.json")["steps"] == 2, "2 GRPO steps"),
    "agents.md": lambda tmp: (
        _check(_summary(tmp / "runs" / "agent" / "summary.json")["steps"] == 2
               and "eval_episodes/success" in _summary(tmp / "runs" / "agent" / "summary.json"),
               "2 GRPO steps of episodes, held-out episodes scored"),
        _check(_summary(tmp / "runs" / "cart" / "summary.json")["steps"] == 2
               and all(abs(sum(r[f"episodes/stop/{why}"] for why in ("answered", "cut", "max_turns", "no_room")) - 1)
                       < 1e-6 for r in map(json.loads, (tmp / "runs" / "cart" / "metrics.jsonl").read_text().splitlines())
                       if "loss" in r),
               "2 GRPO steps in the cart environment, each episode's stop counted")),
    "votes.md": lambda tmp: _check(
        _summary(tmp / "runs" / "dpo" / "summary.json")["objective"] == "dpo"
        and _summary(tmp / "runs" / "kto" / "summary.json")["objective"] == "kto"
        and len((tmp / "pairs.jsonl").read_text().splitlines()) == 12,
        "DPO and KTO from the store; its 12 A or B votes exported as pairs (ties and both-bad left out)"),
    "distributed.md": lambda tmp: _check(
        _summary(tmp / "runs" / "ddp" / "summary.json")["world_size"] == 2
        and _summary(tmp / "runs" / "ddp-dpo" / "summary.json")["world_size"] == 2
        and _summary(tmp / "runs" / "ddp-dpo" / "summary.json")["objective"] == "dpo"
        and _summary(tmp / "runs" / "ddp-grpo" / "summary.json")["world_size"] == 2
        and _summary(tmp / "runs" / "ddp-grpo" / "summary.json")["steps"] == 2, "two ranks, SFT, then DPO, then GRPO"),
}


def _check(ok: bool, said: str) -> None:
    assert ok, f"the tutorial says: {said}"


# Claims the pages made that the code refutes (issue 83's docs read), each with what shows it false: the phrase must
# not come back.
REFUTED = [
    ("docs/tutorials/votes.md", "Not yet: several processes", "DPO, ORPO and KTO run on ranks: test_objectives_on_ranks"),
    ("docs/tutorials/agents.md", "Not yet: episodes under torchrun", "test_episodes runs episodes on two ranks"),
    ("docs/development.md", "needs no downloads", "the set-up installs Chromium, PostgreSQL and builds llama.cpp"),
    ("docs/guides/evaluation.md", "`eval --base --data", "eval refuses --base without --adapter"),
    ("docs/guides/evaluation.md", "out.q4_k_m.gguf", "export names its files NAME-QUANT.gguf"),
    ("docs/guides/data.md", "64 (now the default)", "evaluation.eval_max_new_tokens defaults to 128"),
    ("docs/tutorials/distributed.md", "train exactly like 1 process", "ranks sum in another order: to float rounding"),
    ("docs/guides/fine-tuning.md", "On this 2-core VM", "the machine is named, or said to be unrecorded"),
]


def test_the_studio_page_lists_every_method_and_export_type_the_page_offers():
    """studio.md's lists are the page's own: each method of interfaces/web/studio.METHODS and each export type."""
    pytest.importorskip("gradio", reason="the studio needs gradio (the web extra)")
    from tunebench.interfaces.web import studio

    text = (ROOT / "docs" / "guides" / "studio.md").read_text(encoding="utf-8").lower()
    spelled = {"full": "full", "prefix": "prefix", "prompt": "prompt tuning"}
    assert [m for m in studio.METHODS if spelled.get(m, m) not in text] == []
    assert [q for q in studio.QUANTS if q not in text] == []


@pytest.mark.parametrize("page, phrase, why", REFUTED)
def test_no_page_says_what_the_code_refutes(page, phrase, why):
    assert phrase not in (ROOT / page).read_text(encoding="utf-8"), f"{page} says {phrase!r}; but {why}"


def test_the_new_tokens_default_and_the_no_progress_help_say_what_the_code_does():
    """data.md's default new tokens is the field's; --no-progress's help says it turns the bar off."""
    import contextlib
    import io

    from tunebench.interfaces import cli
    from tunebench.settings.schema import Evaluation

    assert Evaluation().eval_max_new_tokens == 128
    assert "the default is now 128" in (ROOT / "docs" / "guides" / "data.md").read_text(encoding="utf-8")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main(["train", "--help"])
    assert "--no-progress off: a progress bar" in " ".join(out.getvalue().split())
