"""MkDocs hooks and the generated reference pages, so neither can drift from the code.

At every build:
- index.md is the README (its links into docs/ made relative to the site);
- benchmarks/results.md is benchmarks/README.md, every measured table with its machine, date and command; the
  pages link it by its path in the repository (../../benchmarks/README.md, which works there), and the build
  points those links at the site's copy.

Written into the repository by `python docs/hooks.py --write` (a test fails when they differ from the code), so
their links work in the repository view too:
- reference/configuration.md lists every configuration field of `train` and `pretrain` with its type, default
  and documentation (the same documentation `--help` prints: settings.schema.docs);
- reference/cli.md is every job's `--help`, from the parser the command runs;
- reference/machines.md is the machine-level settings tunebench picks on each machine class, from the golden
  tables the suite plans again from each class's record (tests/golden/machines/).
"""

import argparse
import dataclasses
import io
import re
from contextlib import redirect_stdout
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    pages = {"index.md": readme(), "benchmarks/results.md": (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")}
    for uri, text in pages.items():
        files.append(File.generated(config, uri, content=text))
    return files


BENCHMARKS_LINK = re.compile(r"\]\((?:\.\./)+benchmarks/README\.md")


def on_page_markdown(markdown, page, config, files):
    """A link to the repository's benchmarks/README.md goes to the site's copy, benchmarks/results.md."""
    depth = page.file.src_uri.count("/")
    return BENCHMARKS_LINK.sub("](" + "../" * depth + "benchmarks/results.md", markdown)


def generated() -> dict[str, str]:
    """The reference pages made from the code, by their path under docs/."""
    return {"reference/configuration.md": configuration(), "reference/cli.md": cli(),
            "reference/machines.md": machines()}


def readme() -> str:
    """The README as the site's home: links into docs/ lose that prefix."""
    return re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text(encoding="utf-8"))


def configuration() -> str:
    from tunebench.settings import finetune, objectives, pretrain, schema

    out = ["# Configuration reference", "",
           "Every field of a run's configuration, by section, with its default and its documentation (the same text",
           "its `--help` option prints). Set one in a YAML config file (`section:` then `field: value`), as a",
           "dotted override on the command line (`optimizer.lr=1e-4`), or with its option where it has one.",
           "Generated from `src/tunebench/settings/` by `python docs/hooks.py --write` (a test fails when it differs).",
           ""]
    for job, module in (("train", finetune), ("pretrain", pretrain)):
        out += [f"## `tunebench {job}`", ""]
        own = module.SCHEMA.defaults
        if job == "pretrain":  # the shared sections are listed once, under train; pretraining's own defaults here
            out += ["Shared keys whose default pretraining sets otherwise:", "", "| field | pretraining's default |",
                    "|---|---|", *(f"| `{k}` | `{cell(v)}` |" for k, v in own.items() if k.split(".")[0] in schema.SHARED),
                    ""]
        for section, cls in module.SECTIONS.items():
            if job == "pretrain" and section in schema.SHARED:
                continue
            docs = schema.docs(cls)
            out += [f"### `{section}`" + (" (shared by train and pretrain)" if section in schema.SHARED else ""), "",
                    *(["What the adapter is trained toward, and that objective's own settings (each refused for an "
                       "objective it does not belong to: a run holds only its objective's own, with that objective's "
                       "defaults). Also read as `adapter.objective` (the name), `adapter.beta` "
                       "and so on, as configs spelled them before this section.", ""] if section == "objective" else []),
                    "| field | type | default | what it is |", "|---|---|---|---|"]
            for f in dataclasses.fields(cls):
                key = f"{section}.{f.name}"
                default = own.get(key, f.default if f.default is not dataclasses.MISSING else (
                    f.default_factory() if f.default_factory is not dataclasses.MISSING else ""))
                if job == "train" and section == "objective" and objectives.default_text(f.name):
                    default = objectives.default_text(f.name)  # each objective's own
                kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
                out.append(f"| `{key}` | `{cell(kind)}` | `{cell(default)}` | {cell(docs.get(f.name, ''))} |")
            out.append("")
    return "\n".join(out) + "\n"


def cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ") if value is not None else "None"


def cli() -> str:
    import os

    from tunebench.interfaces import cli_parser

    os.environ["COLUMNS"] = "110"  # argparse wraps to the terminal's width: the page is the same on any terminal
    parser = cli_parser.build_parser()
    out = ["# Command-line reference", "",
           "Every job's `--help`, from the parser `tunebench` runs (generated by `python docs/hooks.py --write`; a",
           "test fails when it differs).", "",
           "```text", parser.format_help().rstrip(), "```", ""]
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    for name, sub in subparsers.choices.items():
        text = io.StringIO()
        with redirect_stdout(text):
            sub.print_help()
        out += [f"## `tunebench {name}`", "", "```text", text.getvalue().rstrip(), "```", ""]
    return "\n".join(out)


MACHINES = {"avx2": "a CPU with AVX2 only", "avx512-bf16": "a CPU with AVX512-BF16",
            "avx512-bf16-xeon": "a CPU with AVX512-BF16 whose bf16 measured slower than fp32", "amx": "a CPU with AMX",
            "apple-mps": "an Apple GPU (MPS)", "gpu-8gb": "an 8 GB consumer GPU", "gpu-24gb": "a 24 GB consumer GPU",
            "h100": "an NVIDIA H100"}


def machines() -> str:
    folder = ROOT / "tests" / "golden" / "machines"
    out = ["# The settings on each machine class", "",
           "What `tunebench hw` recommends on each class of machine, each row with its reason: the machine-level rows",
           "of a run's settings table (a run adds what it measures on its own model: the micro batch, the attention",
           "kernel, compile). Each table is generated from `tests/golden/machines/`, which the suite plans again from",
           "that machine's record (`tunebench hw --json`), so a change in what tunebench decides changes this page.",
           "`tunebench hw --machine RECORD.json` prints the same for any machine's record.", ""]
    for name, what in MACHINES.items():
        rows = [line.split(" | ", 2) for line in (folder / f"{name}.txt").read_text().splitlines() if " | " in line]
        command = next(row[1] for row in rows if row[0] == "command")
        out += [f"## {what[0].upper() + what[1:]} (`{name}`)", "", "| setting | value | why |", "|---|---|---|"]
        out += [f"| `{k}` | `{cell(v)}` | {cell(why)} |" for k, v, why in (r for r in rows if len(r) == 3)]
        out += ["", f"It recommends: `{command}`", ""]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python docs/hooks.py --write   (writes docs/reference/{configuration,cli,machines}.md)")
    for uri, text in generated().items():
        (ROOT / "docs" / uri).write_text(text, encoding="utf-8")
        print(f"wrote docs/{uri}")
