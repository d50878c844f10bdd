"""Each objective's own settings: one frozen type per objective holding only its own fields, a tagged union
(`Objective`, tagged by `name`). What a run holds as `cfg.objective` is one of them.

Users spell them as one flat section (settings.finetune.ObjectiveKeys: every key some objective has, so that each
flag, YAML key and old run's config.yaml, which saved them all with None where not the objective's, still
reads); `build` makes the objective's type from that section, refusing a key that is another objective's.

Each type also says, as class facts, what the code around the objective needs to know of it: the kind of data it
learns from (`data`), what one unit of a step is (`unit`), whether it samples its own completions (`samples`); the
loop and recipes read these, never the objective's name (this loader, settings/finetune.py and
training/preference.py's loss_for are the only places that name an objective; tests/test_layers.py holds it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tunebench.core.errors import TunebenchError

PAPERS_DEFAULT = 0.1  # DPO's and KTO's beta and ORPO's lambda, as their papers (and TRL) set them
LOSS_TYPES = ("dapo", "grpo", "dr_grpo")  # GRPO's loss normalisations (training/grpo/)
SCALE_REWARDS = ("group", "none")  # GRPO's advantage: divided by the group's reward spread, or not
# an episode's per-turn credit: against one baseline pooled over a group's turns, or per shared state (GiGPO)
TURN_CREDITS = ("pooled", "state")
EPISODE_DEFAULTS = {"max_turns": 4, "tool_timeout": 10.0}  # GRPO where --environment is given


@dataclass(frozen=True)
class ObjectiveBase:
    """What every objective's type has: its facts as class values and the methods the code reads them by; no
    settings (each type below adds its own). Not an objective itself: a run holds one of the five below."""

    data: ClassVar[str] = "rows"  # what it learns from: rows | pairs (prompt, chosen, rejected) | judged | prompts
    unit: ClassVar[str] = "rows"  # one unit of a step
    samples: ClassVar[bool] = False  # it samples its own completions each step (jobs/grpo.py runs it)
    micro_batch_in_math: ClassVar[bool] = False  # its loss is estimated over each micro batch: never measured

    def check(self) -> None:
        """The objective's own rules, each refused with its fix (settings.finetune.validate calls it)."""

    def report(self) -> dict[str, Any]:
        """What the run's summary records of the objective."""
        return {}

    @property
    def reference_forwards(self) -> int:
        """Forward passes of the reference model per unit (the MFU's FLOPs count them)."""
        return 0

    @property
    def preference(self) -> bool:
        """It learns from judgements of completions (pairs or single verdicts) rather than rows or rewards."""
        return self.data in ("pairs", "judged")


@dataclass(frozen=True)
class SFT(ObjectiveBase):
    """The next-token loss on the replies."""

    name: str = field(default="sft", init=False)


@dataclass(frozen=True)
class DPO(ObjectiveBase):
    """Preference pairs against a reference (Rafailov et al., 2023)."""

    name: str = field(default="dpo", init=False)
    beta: float = PAPERS_DEFAULT
    """how far the model may move from its reference"""
    data: ClassVar[str] = "pairs"
    unit: ClassVar[str] = "pairs"

    def check(self) -> None:
        _positive(("--beta", self.beta))

    def report(self) -> dict[str, Any]:
        return {"objective": self.name, "beta": self.beta}

    @property
    def reference_forwards(self) -> int:
        return 1


@dataclass(frozen=True)
class ORPO(ObjectiveBase):
    """Preference pairs with an odds-ratio term and no reference (Hong et al., 2024)."""

    name: str = field(default="orpo", init=False)
    orpo_lambda: float = PAPERS_DEFAULT
    """the weight of the odds-ratio term (TRL calls it beta)"""
    data: ClassVar[str] = "pairs"
    unit: ClassVar[str] = "pairs"

    def check(self) -> None:
        _positive(("--orpo-lambda", self.orpo_lambda))

    def report(self) -> dict[str, Any]:
        return {"objective": self.name, "orpo_lambda": self.orpo_lambda}


@dataclass(frozen=True)
class KTO(ObjectiveBase):
    """Single judged completions against a KL reference point (Ethayarajh et al., 2024)."""

    name: str = field(default="kto", init=False)
    beta: float = PAPERS_DEFAULT
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    data: ClassVar[str] = "judged"
    unit: ClassVar[str] = "examples"
    micro_batch_in_math: ClassVar[bool] = True  # its KL reference point, over each micro batch (TRL's)

    def check(self) -> None:
        _positive(("--beta", self.beta))
        if not (self.desirable_weight > 0 and self.undesirable_weight > 0):
            raise TunebenchError(f"--desirable-weight and --undesirable-weight must be positive, got "
                                 f"{self.desirable_weight} and {self.undesirable_weight}; TRL's default is 1.0")

    def report(self) -> dict[str, Any]:
        return {"objective": self.name, "beta": self.beta}

    @property
    def reference_forwards(self) -> int:
        return 3  # the completions' and, for the KL reference point, the mismatched pairs', policy and reference


@dataclass(frozen=True)
class GRPO(ObjectiveBase):
    """Rewards of the policy's own sampled completions or episodes (Shao et al., 2024), with TRL's names and
    defaults (but max_completion_length, whose 512 would be slow on a CPU)."""

    name: str = field(default="grpo", init=False)
    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.0  # TRL's: no KL term, no reference pass
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    reward: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
    environment: str | None = None
    max_turns: int | None = None  # None: EPISODE_DEFAULTS where there is an environment
    tool_timeout: float | None = None
    kind_column: str | None = None  # the prompts' column naming each one's kind: per-kind stats (grpo/watch.py)
    balance_kinds: bool = False  # each step's prompts interleaved by kind (batching.balanced_steps)
    turn_credit: str = "pooled"  # TURN_CREDITS: an episode's turns' baseline (grpo.turn_advantages, state_advantages)
    resample_alike: int = 0  # rounds of fresh draws for a group that scored alike (grpo.refill; DAPO); 0: none
    num_iterations: int = 1  # optimizer steps on each step's draws (TRL's num_iterations, the paper's mu)
    data: ClassVar[str] = "prompts"
    unit: ClassVar[str] = "prompts"
    samples: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon)
        _episode_defaults(self)

    def report(self) -> dict[str, Any]:
        return {"objective": self.name, "beta": self.beta}

    @property
    def reference_forwards(self) -> int:
        return 1 if self.beta else 0

    def check(self) -> None:
        """The rewards themselves are built by the job (training/grpo/rewards.py: a file or function that is not there, a
        regex that does not compile) before any model loads."""
        if self.num_generations < 2:
            raise TunebenchError(f"--num-generations must be 2 or more, got {self.num_generations}: GRPO's advantage "
                                 "is a completion's reward against its group's; TRL's default is 8")
        if self.beta < 0 or self.epsilon < 0 or self.epsilon_high < 0:
            raise TunebenchError(f"--beta, --epsilon and --epsilon-high must be 0 or more, got {self.beta}, "
                                 f"{self.epsilon} and {self.epsilon_high}")
        if self.resample_alike < 0:
            raise TunebenchError(f"--resample-alike must be 0 (off) or more rounds, got {self.resample_alike}")
        if self.num_iterations < 1:
            raise TunebenchError(f"--num-iterations must be 1 (one update a draw, TRL's default) or more, got "
                                 f"{self.num_iterations}")
        if self.turn_credit == "state" and self.environment is None:
            raise TunebenchError("--turn-credit state compares the turns of episodes that reached the same context; "
                                 "give --environment FILE.py (or builtin:lookup), or drop it")
        _check_sampling(self)


def _episode_defaults(self: GRPO | RFT) -> None:
    """EPISODE_DEFAULTS where an environment is given and the setting is not."""
    if self.environment:
        for key, value in EPISODE_DEFAULTS.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)


def _check_sampling(self: GRPO | RFT) -> None:
    """What both objectives that sample their own completions must hold."""
    if self.max_completion_length < 1:
        raise TunebenchError(f"--max-completion-length must be 1 or more, got {self.max_completion_length}")
    if not self.temperature > 0 or not 0 < self.top_p <= 1:
        raise TunebenchError(f"--temperature must be above 0 and --top-p in (0, 1], got {self.temperature} and "
                             f"{self.top_p}")
    if self.environment is None and (self.max_turns is not None or self.tool_timeout is not None):
        raise TunebenchError("--max-turns and --tool-timeout set episodes in an environment; give --environment "
                             "FILE.py (or builtin:lookup), or drop them")
    if self.environment is not None and not (self.max_turns >= 1 and self.tool_timeout > 0):
        raise TunebenchError(f"--max-turns must be 1 or more and --tool-timeout above 0, got {self.max_turns} "
                             f"and {self.tool_timeout}")
    if not self.reward and self.environment is None:
        raise TunebenchError(f"--objective {self.name} needs at least one --reward: gsm8k, format:REGEX, exact, "
                             "contains or path/to/file.py:function (or --environment, whose reward scores each "
                             "episode)")
    if self.balance_kinds and not self.kind_column:
        raise TunebenchError("--balance-kinds interleaves each step's prompts by their kind; give --kind-column "
                             "COLUMN (the rows' kind), or drop it")
    if self.reward_weights and len(self.reward_weights) != len(self.reward):
        raise TunebenchError(f"--reward-weights gives {len(self.reward_weights)} weight(s) for "
                             f"{len(self.reward)} reward(s); give one weight per --reward, in the same order")


@dataclass(frozen=True)
class RFT(ObjectiveBase):
    """Rejection-sampling fine-tuning, as expert iteration (Anthony et al., 2017; Havrilla et al., 2024) and RAFT
    online (Dong et al., 2023; RAFT++, Xiong et al., 2025): each step samples num_generations completions (or
    episodes) of its prompts from the policy as it trains, with GRPO's environments and rewards, keeps those whose
    weighted reward passes --min-reward, and trains on them with the next-token loss (balanced by kind where
    --kind-column names one). No reference, no advantage: on a small model that cannot yet tell its questions'
    kinds apart, it learns only from what worked."""

    name: str = field(default="rft", init=False)
    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    min_reward: float | None = None  # None: above 0, tunebench's success (an episode's held-out success too)
    reward: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
    environment: str | None = None
    max_turns: int | None = None
    tool_timeout: float | None = None
    kind_column: str | None = None
    balance_kinds: bool = False
    data: ClassVar[str] = "prompts"
    unit: ClassVar[str] = "prompts"
    samples: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _episode_defaults(self)

    def report(self) -> dict[str, Any]:
        return {"objective": self.name, "min_reward": self.min_reward}

    def kept(self, reward: float) -> bool:
        """Whether a completion of this weighted reward is trained on."""
        return reward > 0 if self.min_reward is None else reward >= self.min_reward

    def check(self) -> None:
        if self.num_generations < 1:
            raise TunebenchError(f"--num-generations must be 1 or more, got {self.num_generations}: the completions "
                                 "sampled a prompt, of which those passing --min-reward are trained on")
        _check_sampling(self)


Objective = SFT | DPO | ORPO | KTO | GRPO | RFT
KINDS: tuple[type, ...] = (SFT, DPO, ORPO, KTO, GRPO, RFT)
BY_NAME: dict[str, type] = {kind().name: kind for kind in KINDS}  # every field but the name has a default
NAMES = tuple(BY_NAME)


def own_keys(kind: type) -> tuple[str, ...]:
    """The settings an objective's type holds (its name aside)."""
    return tuple(f.name for f in dataclasses.fields(kind) if f.init)


def owners(key: str) -> tuple[str, ...]:
    return tuple(name for name, kind in BY_NAME.items() if key in own_keys(kind))


def build(given: dict[str, Any]) -> Objective:
    """The objective of the section's keys as given (None or an empty list: not given; the rest defaults to the
    objective's own), a key of another objective's refused: TRL calls ORPO's lambda beta, and a value given for
    another objective must not vanish unused."""
    name = given.get("name") or "sft"
    if name not in BY_NAME:
        raise TunebenchError(f"objective.name '{name}' is not one of {', '.join(NAMES)}; pick one of those")
    kind = BY_NAME[name]
    own = own_keys(kind)
    for key, value in given.items():
        if key == "name" or value in (None, ()) or key in own:
            continue
        holders = owners(key)
        whose = " and ".join(o.upper() + "'s" for o in holders)
        raise TunebenchError(f"--{key.replace('_', '-')} is {whose}, and this run's objective is {name}; " + (
            "ORPO's weight is --orpo-lambda" if key == "beta" and name == "orpo"
            else f"drop it or use --method {holders[0]}"))
    return kind(**{k: v for k, v in given.items() if k in own and v is not None})


def every_key(o: Objective, keys: tuple[str, ...]) -> dict[str, Any]:
    """The objective as the flat section saved it before it was typed: each of `keys`, None (or an empty list)
    where not its own; a resume compares this with its checkpoint's (jobs.parts.finetune_model.identity)."""
    return {"name": o.name, **{k: getattr(o, k, [] if k in ("reward", "reward_weights") else None) for k in keys}}


def default_text(key: str) -> str | None:
    """What an objective's own setting defaults to, by objective ("0.1 for DPO and KTO, 0.0 for GRPO"), for its
    --help and the configuration reference; None where no objective gives it a value."""
    given = {name: f.default for name, kind in BY_NAME.items() for f in dataclasses.fields(kind)
             if f.name == key and f.init and f.default not in (None, ())}
    return ", ".join(f"{v} for {' and '.join(o.upper() for o, w in given.items() if w == v)}"
                     for v in dict.fromkeys(given.values())) or None


def _positive(*named: tuple[str, float]) -> None:
    for flag, value in named:
        if not value > 0:
            raise TunebenchError(f"{flag} must be positive, got {value}; the papers' default is 0.1")
