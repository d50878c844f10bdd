"""What each machine class is known to do: shipped records of measured outcomes, the one nearest this machine, and
the predictions `auto` starts from.

A record (configs/machines/<class>.json, `FORMAT` 1) is what `tunebench hw --record` writes on a machine: its
class (the widest matrix unit of its CPU, the precision its runs compute in, its cores) and, for the shapes
measured there (model size and depth, max length, method), the tokens/s of each attention kernel and of each
micro batch. A run measures its candidates in the order the nearest record predicts, and a candidate the run is
too short to repay measuring is taken from that prediction, its row naming the record it came from.

Nothing is taken from a record of another precision or device: an fp32 run on a bf16 machine is predicted from
fp32 records only. Another matrix unit, core count, model size or max length than the record's is named in
the row. Only ratios are taken (micro batch 4 against 2, sdpa against eager), never a record's absolute speed:
the same class at another clock is slower or faster by the same factor for every candidate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tunebench.core.errors import TunebenchError

FORMAT = 1
SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "machines"
# The CPU's widest matrix unit, narrowest first: a record of the same unit predicts best, then the nearest.
UNITS = ("none", "avx2", "avx512", "avx512-bf16", "amx")
LABEL = {"none": "no-AVX2", "avx2": "AVX2", "avx512": "AVX512", "avx512-bf16": "AVX512-BF16", "amx": "AMX"}


# How far a recorded shape may be from the run's and still predict it: 10x the parameters (a 0.135B record
# predicts a 1.07B model's order, not a 1M-parameter test model's), 4x the max length.
FARTHEST = (10.0, 4.0)


def unit(cpu_flags) -> str:
    """The widest matrix unit a CPU has, from its flags (cpuspeed.CPU_FEATURES' names)."""
    flags = set(cpu_flags)
    return ("amx" if "amx_bf16" in flags else "avx512-bf16" if "avx512_bf16" in flags
            else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "none")


@dataclass(frozen=True)
class Recorded:
    """What one shape measured on a record's machine: tokens/s by attention kernel (at `attention_rows` rows)
    and by micro batch (with the kernel the run kept)."""

    model: str  # a name for people: "SmolLM2-135M", "Llama 0.42B from a config"
    params: int
    layers: int
    method: str  # lora | qlora | full | pretrain (the measurement cache's method)
    max_length: int
    attention_rows: int | None
    attention: dict[str, float]
    micro_batch: dict[int, float]
    compile: dict | None = None  # {"eager": tokens/s, "compiled": tokens/s, "micro_batch": n} where measured
    # A micro batch no probe ran in the process: its first steps' extra time, in steady micro batches of it (AMX
    # bf16: new shapes' kernels and first-touched memory), where measured; None: not measured on this class.
    first_steps: float | None = None

    def to_dict(self) -> dict:
        return {"model": self.model, "params": self.params, "layers": self.layers, "method": self.method,
                "max_length": self.max_length, "attention_rows": self.attention_rows, "attention": self.attention,
                "micro_batch": {str(k): v for k, v in sorted(self.micro_batch.items())},
                **({"compile": self.compile} if self.compile else {}),
                **({"first_steps": self.first_steps} if self.first_steps is not None else {})}


@dataclass(frozen=True)
class Record:
    name: str
    unit: str
    precision: str
    cores: int
    cpu_model: str
    source: str  # where and when it was measured, and how
    outcomes: tuple[Recorded, ...]

    @property
    def label(self) -> str:
        return f"{LABEL[self.unit]} {self.precision}"

    def to_dict(self) -> dict:
        return {"format": FORMAT, "class": self.name, "unit": self.unit, "precision": self.precision,
                "cores": self.cores, "cpu_model": self.cpu_model, "source": self.source,
                "outcomes": [o.to_dict() for o in self.outcomes]}


def parse(raw: dict, where: str) -> Record:
    """A record from its JSON, or a one-line refusal naming what is wrong with it."""
    try:
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, this tunebench reads format {FORMAT}")
        if raw["unit"] not in UNITS:
            raise ValueError(f"unit {raw['unit']!r} is not one of {', '.join(UNITS)}")
        outcomes = tuple(Recorded(o["model"], int(o["params"]), int(o["layers"]), o["method"], int(o["max_length"]),
                                 o.get("attention_rows"), {k: float(v) for k, v in o.get("attention", {}).items()},
                                 {int(k): float(v) for k, v in o.get("micro_batch", {}).items()}, o.get("compile"),
                                 None if o.get("first_steps") is None else float(o["first_steps"]))
                         for o in raw["outcomes"])
        return Record(raw["class"], raw["unit"], raw["precision"], int(raw["cores"]), raw.get("cpu_model", ""),
                      raw.get("source", ""), outcomes)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise TunebenchError(f"machine record {where} cannot be read ({type(e).__name__}: {e}); write it again "
                             "with `tunebench hw --record FILE`") from None


def load(path: Path) -> Record:
    return parse(json.loads(Path(path).read_text()), str(path))


def shipped() -> tuple[Record, ...]:
    return tuple(load(p) for p in sorted(SHIPPED.glob("*.json")))


@dataclass(frozen=True)
class Known:
    """The prediction for one run: the nearest record's outcome for the nearest shape, and how near it is."""

    record: Record
    outcome: Recorded
    differs: tuple[str, ...]  # what about this machine or run is not the record's
    same_shape: bool = False  # the outcome is of the run's shape (size, length and method), if not its machine

    @property
    def source(self) -> str:
        """'AVX2 fp32 machines (SmolLM2-135M lora at 128 tokens, 2 cores; this machine: AVX512-BF16)'."""
        o = self.outcome
        said = f"{o.model} {o.method} at {o.max_length} tokens, {self.record.cores} cores"
        return f"{self.record.label} machines ({said}" + (f"; here: {', '.join(self.differs)})" if self.differs
                                                          else ")")

    @property
    def first_steps(self) -> float | None:
        """A cold micro batch's first steps' extra time, in steady micro batches of it, on record (None: not)."""
        return self.outcome.first_steps

    def kernel_ratio(self, kernel: str, against: str) -> float | None:
        a, b = self.outcome.attention.get(kernel), self.outcome.attention.get(against)
        return a / b if a and b else None

    def kernel_order(self, candidates: tuple[str, ...]) -> tuple[str, ...]:
        """`candidates`, fastest on record first; kernels the record did not measure keep their order after."""
        seen = self.outcome.attention
        return tuple(sorted(candidates, key=lambda k: (k not in seen, -seen.get(k, 0.0))))

    def micro_ratio(self, micro: int, against: int) -> float | None:
        a, b = self.outcome.micro_batch.get(micro), self.outcome.micro_batch.get(against)
        return a / b if a and b else None

    def best_micro(self, sizes: list[int]) -> int | None:
        """The candidate the record measured fastest, None if it measured none of them."""
        on_record = [s for s in sizes if s in self.outcome.micro_batch]
        return max(on_record, key=self.outcome.micro_batch.get) if on_record else None


def nearest(records, unit_: str, precision: str, cores: int, params: int, max_length: int,
            method: str) -> Known | None:
    """The prediction for a run of `params` parameters at `max_length` with `method` on a CPU of `unit_` and
    `cores` computing in `precision`: the record of that precision nearest in matrix unit, then cores; in it,
    the outcome nearest in method, size and length. None when no record computes in `precision`, or none of its
    shapes is within `FARTHEST` of the run's."""
    same = [r for r in records if r.precision == precision and r.outcomes]
    if not same:
        return None
    here = UNITS.index(unit_)
    record = min(same, key=lambda r: (abs(UNITS.index(r.unit) - here), abs(math.log2(r.cores / max(cores, 1)))))

    def distance(o: Recorded) -> float:
        family = o.method.split("+")[0] in ("lora", "qlora") and method.split("+")[0] in ("lora", "qlora")
        return ((0 if o.method == method else 1 if family else 3) + abs(math.log2(o.params / max(params, 1)))
                + abs(math.log2(o.max_length / max(max_length, 1))))

    outcome = min(record.outcomes, key=distance)
    if not (1 / FARTHEST[0] <= outcome.params / max(params, 1) <= FARTHEST[0]
            and 1 / FARTHEST[1] <= outcome.max_length / max(max_length, 1) <= FARTHEST[1]):
        return None  # no shape on record near enough: the run measures, as on a machine with no record
    shape = [f"{params / 1e9:.2f}B parameters" if not 0.8 <= outcome.params / max(params, 1) <= 1.25 else "",
             f"{max_length} tokens" if outcome.max_length != max_length else "",
             method if outcome.method != method else ""]
    differs = [f"{LABEL[unit_]}" if record.unit != unit_ else "", f"{cores} cores" if record.cores != cores else "",
               *shape]
    return Known(record, outcome, tuple(d for d in differs if d), not any(shape))


def model_size(model) -> dict:
    """{"model_params", "model_layers"} of a model being trained, as a record's outcome keeps them."""
    from tunebench.model import methods
    config = methods.base_of(model).config
    return {"model_params": sum(p.numel() for p in model.parameters()),
            "model_layers": int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0) or 0)}


def from_cache(entries: dict, cpu_model: str, cores: int, cpu_flags, precision: str, source: str) -> Record | None:
    """This machine's record at `precision`, from the measurement cache (tune.cache_file's entries): every
    complete micro-batch probe measured on this CPU, with the attention kernels timed for the same shape.
    None when the cache holds none."""
    def shape(key: str) -> tuple[str, dict] | None:
        kind, _, raw = key.partition("|")
        fields = json.loads(raw) if raw.startswith("{") else {}
        where = str(fields.get("where", ""))
        if fields.get("precision") != precision or not where.startswith(f"{cpu_model} x"):
            return None
        return kind, fields

    same = lambda f: (f["model"], f["method"], f["max_length"], f["where"], f.get("r"))  # noqa: E731
    kernels = {}
    for key, hit in entries.items():
        parsed = shape(key)
        if parsed and parsed[0] == "attention" and hit.get("speeds"):
            kernels[same(parsed[1])] = hit
    outcomes = []
    for key, hit in entries.items():
        parsed = shape(key)
        if not parsed or parsed[0] != "batch" or "model_params" not in hit or "result" not in hit:
            continue
        f = parsed[1]
        micro = {p["micro_batch_size"]: p["tokens_per_s"] for p in hit["result"]["probes"]
                 if p["status"] == "ok" and p["tokens_per_s"]}
        att = kernels.get(same(f), {})
        if micro:
            outcomes.append(Recorded(Path(str(f["model"])).name, int(hit["model_params"]), int(hit["model_layers"]),
                                    f["method"], int(f["max_length"]), att.get("rows"), att.get("speeds", {}), micro))
    if not outcomes:
        return None
    unit_ = unit(cpu_flags)
    return Record(f"{unit_}-{precision}", unit_, precision, cores, cpu_model, source, tuple(outcomes))


def for_run(hw, precision: str, device_type: str, threads: int, model, max_length: int, method: str) -> Known | None:
    """The prediction for a run on `threads` of this CPU from the shipped records, or None (a GPU, or no record
    of its precision)."""
    if device_type != "cpu":
        return None
    return nearest(shipped(), unit(hw.cpu_flags), precision, threads, model_size(model)["model_params"], max_length,
                   method)
