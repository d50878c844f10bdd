from tunebench.cli import entry

raise SystemExit(entry())
