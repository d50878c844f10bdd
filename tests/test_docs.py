"""The documentation as a user meets it: the site builds in strict mode (a broken link or anchor fails), every
`tunebench` / `./run` command in the README and the docs parses with the parser the command runs, the data
formats' example rows are read as the format they claim, and the blocks marked `<!-- docs-test: run -->` (the
README's four commands and the CSV tutorial's) run exactly as written, on the default model."""

import contextlib
import csv
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import unavailable

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


def test_every_documented_command_parses():
    from tunebench.core.errors import TunebenchError
    from tunebench.interfaces import cli_parser

    parser = cli_parser.build_parser()
    seen, failures = 0, []
    for page in PAGES:
        for _, lines in blocks(page):
            for line in lines:
                argv = tunebench_argv(line)
                if argv is None:
                    continue
                seen += 1
                try:
                    parser.parse_known_args(argv)
                except (TunebenchError, SystemExit) as e:
                    failures.append(f"{page.relative_to(ROOT)}: {line}: {e}")
    assert not failures, "\n".join(failures)
    assert seen > 50, seen  # the README, the tutorials and the guides hold this many at least


def test_a_wrong_flag_in_a_documented_command_is_caught(tmp_path):
    from tunebench.core.errors import TunebenchError
    from tunebench.interfaces import cli_parser

    page = tmp_path / "page.md"
    page.write_text("```bash\n./run export runs/x --formats ollama   # a typo\n```\n")
    [(_, [line])] = blocks(page)
    with pytest.raises(TunebenchError, match="--formats"):
        parsed, extra = cli_parser.build_parser().parse_known_args(tunebench_argv(line))
        if extra:
            raise TunebenchError(f"unrecognized argument(s): {' '.join(extra)}")


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


def test_the_readme_and_the_csv_tutorial_run_as_written(tmp_path, monkeypatch, capsys):
    """Every block marked to run, in page order: the README's four commands, then the tutorial's (the same
    run directory; the tutorial's train and export lines are the README's, run once). Ollama is not needed by
    tunebench and is not installed here: its two lines run where `ollama` is on PATH; otherwise the Modelfile
    they load, and the GGUF it names, are checked, with the line export printed."""
    from tunebench.interfaces import cli

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
            if line.startswith("ollama") and shutil.which("ollama"):
                subprocess.run(shlex.split(line), check=True, timeout=600)
            continue
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = cli.main(argv)
        printed += out.getvalue()
        assert code == 0, f"{line}\n{out.getvalue()[-3000:]}"
    modelfile = tmp_path / "runs" / "my-model-ollama" / "Modelfile"
    source = modelfile.read_text().splitlines()[0]
    assert source == "FROM ./my-model-q8_0.gguf" and (modelfile.parent / source[7:]).stat().st_size > 50e6
    readme = ROOT.joinpath("README.md").read_text()
    assert "ollama create my-model -f runs/my-model-ollama/Modelfile" in readme
    assert "ollama create my-model -f runs/my-model-ollama/Modelfile" in printed  # what export tells the user
    table = {line.split()[0]: line.split() for line in printed.splitlines() if line.split()[:1] in (
        ["model"], ["base"], ["my-model"])}
    assert {"model", "base", "my-model"} <= set(table) and "rougeL" in table["model"], printed[-3000:]
