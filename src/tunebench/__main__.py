from tunebench.interfaces.cli import entry

raise SystemExit(entry())
