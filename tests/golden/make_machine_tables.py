"""Each machine class's settings table: what tunebench picks there, planned here from the machine's record.

tests/golden/machines/<class>.json is a record as `tunebench hw --json` writes it (avx512-bf16 was taken on
the machine this file was first run on, a 2-core AMD EPYC; avx512-bf16-xeon on a 2-core Intel Xeon, model 207,
whose VM shows AVX512-BF16 and no AMX, with its measured bf16_over_fp32, 2026-12-03; the others are written in the
same form from the machines' published specifications: core counts, CPU flags, GPU name, memory and compute
capability). Beside each,
<class>.txt is the table `tunebench hw --machine <class>.json` prints, with the command it recommends.
tests/test_hardware.py plans every record again and compares: a change to any decision shows on every
class, not only on the developer's machine. When a change is meant, run this and commit the tables with it:

    .venv/bin/python tests/golden/make_machine_tables.py     # rewrites tests/golden/machines/*.txt
"""

from __future__ import annotations

from pathlib import Path

MACHINES = Path(__file__).parent / "machines"
CLASSES = ("avx2", "avx512-bf16", "avx512-bf16-xeon", "amx", "h100", "gpu-24gb", "gpu-8gb", "apple-mps")
# the memory plans each class's table ends with: `tunebench hw --machine <class>.json --model <config> --method <m>`
PLANS = (("smollm2-135m", "lora"), ("llama-3-8b", "lora"), ("llama-3-8b", "qlora"), ("llama-3-8b", "full"))


def table(record: Path) -> str:
    """The class's settings as `tunebench hw --machine` plans them, one `setting | value | reason` a line, then
    the recommended command, then the memory plan of each of PLANS (models/<name>.json: their configs alone)."""
    from tunebench.jobs import hw

    _, rows, command = hw.recorded(str(record))
    lines = [f"{r.setting} | {r.value} | {r.reason}" for r in rows] + [f"command | {command}"]
    for name, method in PLANS:
        _, planned, _ = hw.recorded(str(record), str(MACHINES / "models" / f"{name}.json"), method)
        plan = planned[-1]
        lines.append(f"{plan.setting} {name} {method} | {plan.value} | {plan.reason}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    for name in CLASSES:
        (MACHINES / f"{name}.txt").write_text(table(MACHINES / f"{name}.json"))
        print(f"wrote {MACHINES / name}.txt")
