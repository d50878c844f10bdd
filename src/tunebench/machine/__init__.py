"""The machine: what it has and what it is asked to do (hardware), the process group (distributed),
what it did (metrics, monitor). Imports only core."""
