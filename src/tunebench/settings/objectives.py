"""Each objective's own settings: one frozen type per objective holding only its own fields, a tagged union
(`Objective`, tagged by `name`). What a run holds as `cfg.objective` is one of them.

Each setting is declared once, with its documentation, in the type that holds it (GRPO's and RFT's shared ones in
`SampledObjective`). Users spell them as one flat section made from those types (`flat_section`, settings.finetune's
ObjectiveKeys: every key some objective has, so that each flag, YAML key and old run's config.yaml, which saved
them all with None where not the objective's, still reads); `build` makes the objective's type from that section,
refusing a key that is another objective's.

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
from tunebench.settings.schema import docs

PAPERS_DEFAULT = 0.1  # DPO's and KTO's beta and ORPO's lambda, as their papers (and TRL) set them
LOSS_TYPES = ("dapo", "grpo", "dr_grpo")  # GRPO's loss normalisations (training/grpo/)
SCALE_REWARDS = ("group", "none")  # GRPO's advantage: divided by the group's reward spread, or not
# an episode's per-turn credit: against one baseline pooled over a group's turns, or per shared state (GiGPO)
TURN_CREDITS = ("pooled", "state")
EPISODE_DEFAULTS = {"max_turns": 4, "tool_timeout": 10.0}  # GRPO where --environment is given
# GRPO's --negative-weight where --environment is given: on the towns benchmark's validation set (45 minutes an
# arm, 2 cores, kind weights on) 0.5 gained over 1 on both seeds (+7.3, +6.0), +6.7 [+2.0, +11.3] pooled
# (benchmarks/README.md); runs with an environment made before 2026-12-05 trained at 1
NEGATIVE_WEIGHT_EPISODES = 0.5
# a preference pair objective's evaluation (training/preference.py's pair figures), as ObjectiveBase.eval_words
PAIR_EVAL = (("loss", "eval_loss", ".4f"), ("reward accuracy", "eval_rewards/accuracies", ".3f"),
             ("margin", "eval_rewards/margins", ".4f"))


@dataclass(frozen=True)
class ObjectiveBase:
    """What every objective's type has: its facts as class values and the methods the code reads them by; no
    settings (each type below adds its own). Not an objective itself: a run holds one of the five below."""

    data: ClassVar[str] = "rows"  # what it learns from: rows | pairs (prompt, chosen, rejected) | judged | prompts
    unit: ClassVar[str] = "rows"  # one unit of a step
    samples: ClassVar[bool] = False  # it samples its own completions each step (jobs/grpo.py runs it)
    micro_batch_in_math: ClassVar[bool] = False  # its loss is estimated over each micro batch: never measured
    # its own charts in a run's report, after the loss (jobs/run_report.py draws each set named here)
    charts: ClassVar[tuple[str, ...]] = ()
    # its held-out evaluation in words (describe_eval): (label, the eval record's key, format) for each figure the
    # record holds, then what the figures are over (the record's count key, its noun), if it says
    eval_words: ClassVar[tuple[tuple[str, str, str], ...]] = (("loss", "eval_loss", ".4f"),
                                                              ("perplexity", "perplexity", ".2f"))
    eval_over: ClassVar[tuple[str, str] | None] = None

    def check(self) -> None:
        """The objective's own rules, each refused with its fix (settings.finetune.validate calls it)."""

    def measured_as(self, method: str) -> str:
        """The fine-tuning method as the measurement cache keys a run of this objective: a preference objective's
        steps (its reference pass, its pairs or judgements) are not SFT's, so its own name is added."""
        return f"{method}+{self.name}" if self.preference else method

    def report(self) -> dict[str, Any]:
        """What the run's summary records of the objective."""
        return {}

    def describe_eval(self, e: dict[str, Any]) -> str:
        """An evaluation's figures in words, as this objective's evaluation records them (`eval_words`)."""
        words = ", ".join(f"{label} {e[key]:{form}}" for label, key, form in self.eval_words if e.get(key) is not None)
        if self.eval_over and self.eval_over[0] in e:
            words += f" on {e[self.eval_over[0]]} {self.eval_over[1]}"
        return words

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
    charts: ClassVar[tuple[str, ...]] = ("preference",)
    eval_words: ClassVar[tuple[tuple[str, str, str], ...]] = PAIR_EVAL
    eval_over: ClassVar[tuple[str, str] | None] = ("eval_pairs", "held-out pairs")

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
    charts: ClassVar[tuple[str, ...]] = ("preference",)
    eval_words: ClassVar[tuple[tuple[str, str, str], ...]] = PAIR_EVAL
    eval_over: ClassVar[tuple[str, str] | None] = ("eval_pairs", "held-out pairs")

    def check(self) -> None:
        _positive(("--orpo-lambda", self.orpo_lambda))

    def report(self) -> dict[str, Any]:
        return {"objective": self.name, "orpo_lambda": self.orpo_lambda}


@dataclass(frozen=True)
class KTO(ObjectiveBase):
    """Single judged completions against a KL reference point (Ethayarajh et al., 2024)."""

    name: str = field(default="kto", init=False)
    beta: float = PAPERS_DEFAULT
    """how far the model may move from its reference"""
    desirable_weight: float = 1.0
    """the weight of a desirable completion's loss (TRL suggests balancing the two kinds' counts)"""
    undesirable_weight: float = 1.0
    """the weight of an undesirable completion's loss"""
    data: ClassVar[str] = "judged"
    unit: ClassVar[str] = "examples"
    charts: ClassVar[tuple[str, ...]] = ("judgements",)
    eval_words: ClassVar[tuple[tuple[str, str, str], ...]] = (
        ("loss", "eval_loss", ".4f"), ("KL", "eval_kl", ".4f"), ("desirable reward", "eval_rewards/chosen", ".4f"),
        ("undesirable reward", "eval_rewards/rejected", ".4f"))
    eval_over: ClassVar[tuple[str, str] | None] = ("eval_examples", "held-out completions")
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
class SampledObjective(ObjectiveBase):
    """What the two objectives that sample their own completions (GRPO, RFT) share: how they sample, what scores a
    completion, the environment an episode runs in and the prompts' kinds. Not an objective itself."""

    num_generations: int = 8
    """completions sampled per prompt (GRPO's group)"""
    max_completion_length: int = 256
    """new tokens per completion"""
    temperature: float = 1.0
    """the sampling temperature"""
    top_p: float = 1.0
    """nucleus sampling (1.0: off)"""
    reward: tuple[str, ...] = ()
    """reward functions, each gsm8k[:COLUMN] | format:REGEX | exact[:COLUMN] | contains[:COLUMN] |
    path/to/file.py:function (TRL's signature: prompts, completions, **columns)"""
    reward_weights: tuple[float, ...] = ()
    """one weight per --reward (default 1 each)"""
    environment: str | None = None
    """the tools' environment: a Python file defining TOOLS, reset(row) and reward(messages, row), or
    builtin:lookup; each completion becomes an episode of turns in which the model's tool calls run
    (training/grpo/environment.py)"""
    max_turns: int | None = None  # None: EPISODE_DEFAULTS where there is an environment
    """with --environment, the model's turns an episode may take (default 4)"""
    tool_timeout: float | None = None
    """with --environment, seconds a tool call may take before the model is told it gave no answer (default 10)"""
    kind_column: str | None = None  # per-kind stats (grpo/watch.py)
    """the prompts' column naming each one's kind (a task type, a difficulty): each kind's training reward and share
    of groups that taught anything are logged a step, drawn in the report, and a kind whose groups stay alike below
    the run's best is warned of; RFT balances its kept completions by kind"""
    balance_kinds: bool = False  # batching.balanced_steps
    """with --kind-column, each step's prompts taken one of each kind in turn (so a step of at least as many prompts
    as kinds holds every kind while each has prompts left), not shuffled together"""
    data: ClassVar[str] = "prompts"
    unit: ClassVar[str] = "prompts"
    samples: ClassVar[bool] = True
    charts: ClassVar[tuple[str, ...]] = ("sampled",)

    def __post_init__(self) -> None:
        _episode_defaults(self)


@dataclass(frozen=True)
class GRPO(SampledObjective):
    """Rewards of the policy's own sampled completions or episodes (Shao et al., 2024), with TRL's names and
    defaults (but max_completion_length, whose 512 would be slow on a CPU)."""

    name: str = field(default="grpo", init=False)
    beta: float = 0.0
    """the weight of the KL term against the policy the run started from (0, TRL's: no KL term, no reference
    pass)"""
    epsilon: float = 0.2
    """the clipping epsilon"""
    epsilon_high: float | None = None
    """the upper clipping epsilon (default: --epsilon; DAPO's paper: 0.28)"""
    loss_type: str = "dapo"
    """dapo (TRL's: over the step's completion tokens) | grpo (per completion) | dr_grpo"""
    scale_rewards: str = "group"
    """group (advantages divided by the group's std) | none (Dr. GRPO)"""
    turn_credit: str = "pooled"  # TURN_CREDITS (grpo.turn_advantages, state_advantages)
    """with --environment, each turn's credit against one baseline pooled over the group's turns (pooled, the GRPO
    paper's process supervision) | against the episodes that reached the same context (state: GiGPO's anchor
    states; a turn's advantage is its episode's plus its return's against theirs)"""
    resample_alike: int = 0  # grpo.refill
    """rounds a group whose completions all scored alike (it teaches nothing at --beta 0) is drawn again, the first
    fresh group that differs taking its place (DAPO's dynamic sampling, for the step's own prompts); 0: off"""
    weigh_kinds: bool | None = None  # steps.StepRows.groups_of; None: on where --kind-column is given
    """with --kind-column, each kind among a step's groups that teach carries the same share of its update, as RFT
    weighs its kept completions (a kind whose groups rarely differ is not outweighed by one the policy already
    solves; default on with --kind-column, chosen on the towns benchmark's validation set); off: every group that
    teaches counts the same"""
    negative_weight: float | None = None  # grpo.Advantages; None: NEGATIVE_WEIGHT_EPISODES with --environment, else 1
    """each credit below 0 (a completion's advantage, or a turn's, where it did worse than its group) times this: 1
    (GRPO's) pushes away from what failed as hard as it pulls toward what worked; below 1 leans toward what worked,
    as RFT does (0: successes only; Zhu et al., 2025 split the two as positive and negative sample reinforcement);
    above 1 leans toward pushing away (their W-REINFORCE). Default 0.5 with --environment (chosen on the towns
    benchmark's validation set, two seeds: +6.7 points over 1, paired), 1 without (not measured there)"""
    num_iterations: int = 1
    """optimizer steps taken on each step's draws (TRL's num_iterations, the GRPO paper's mu): the first at the
    policy that sampled them, each later one's ratio against the log-probabilities they had when drawn (one forward
    pass more a draw), so --epsilon clips; 1 (TRL's): one update a draw"""

    def __post_init__(self) -> None:
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon)
        if self.weigh_kinds is None:
            object.__setattr__(self, "weigh_kinds", bool(self.kind_column))
        if self.negative_weight is None:
            object.__setattr__(self, "negative_weight", NEGATIVE_WEIGHT_EPISODES if self.environment else 1.0)
        super().__post_init__()

    def report(self) -> dict[str, Any]:
        return {"objective": self.name, "beta": self.beta}

    @property
    def reference_forwards(self) -> int:
        return 1 if self.beta else 0

    def alike_fix(self) -> str:
        """What the collapse watch says of a kind whose groups all score alike below the run's best."""
        if self.beta:
            return f"only the KL anchor (--beta {self.beta:g}) keeps them in the update"
        return "at --beta 0 nothing pulls this kind back (a KL anchor, --beta 0.04, keeps them in the update)"

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
        if self.negative_weight < 0:  # the schema refuses what is not a finite number
            raise TunebenchError(f"--negative-weight must be 0 (successes only) or more (1: GRPO's), got "
                                 f"{self.negative_weight}")
        if self.num_iterations < 1:
            raise TunebenchError(f"--num-iterations must be 1 (one update a draw, TRL's default) or more, got "
                                 f"{self.num_iterations}")
        if self.weigh_kinds and not self.kind_column:
            raise TunebenchError("--weigh-kinds gives each kind of a step an equal share of its update; give "
                                 "--kind-column COLUMN (the rows' kind), or drop it")
        if self.turn_credit == "state" and self.environment is None:
            raise TunebenchError("--turn-credit state compares the turns of episodes that reached the same context; "
                                 "give --environment FILE.py (or builtin:lookup), or drop it")
        _check_sampling(self)


def _episode_defaults(self: SampledObjective) -> None:
    """EPISODE_DEFAULTS where an environment is given and the setting is not."""
    if self.environment:
        for key, value in EPISODE_DEFAULTS.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)


def _check_sampling(self: SampledObjective) -> None:
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
class RFT(SampledObjective):
    """Rejection-sampling fine-tuning, as expert iteration (Anthony et al., 2017; Havrilla et al., 2024) and RAFT
    online (Dong et al., 2023; RAFT++, Xiong et al., 2025): each step samples num_generations completions (or
    episodes) of its prompts from the policy as it trains, with GRPO's environments and rewards, keeps those whose
    weighted reward passes --min-reward, and trains on them with the next-token loss (balanced by kind where
    --kind-column names one). No reference, no advantage: on a small model that cannot yet tell its questions'
    kinds apart, it learns only from what worked."""

    name: str = field(default="rft", init=False)
    min_reward: float | None = None
    """a sampled completion is trained on when its weighted reward is at least this (default: above 0, tunebench's
    success; an episode's held-out success too)"""

    def report(self) -> dict[str, Any]:
        return {"objective": self.name, "min_reward": self.min_reward}

    def alike_fix(self) -> str:
        """What the collapse watch says of a kind whose episodes all fail (training/grpo/watch.py)."""
        return ("RFT keeps none of its episodes, so this kind is not trained on (more --num-generations give it more "
                "tries a step)")

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


NAME_DOC = ("sft (the loss on the replies) | dpo | orpo (preference pairs: prompt/chosen/rejected rows, or the A/B "
            "store of tunebench serve as --data) | kto (judged completions: prompt/completion/label rows, or the A/B "
            "store) | grpo (prompts, and --reward) | rft (prompts and --reward: rejection-sampling fine-tuning)")


def flat_section(kinds: tuple[type, ...] = KINDS) -> type:
    """The objective section as users spell it (flags, YAML, old runs' config.yaml, --help, the configuration
    reference), made from the types: every setting some objective has, None (or an empty list) where not given
    (`build` then takes the objective's own default), documented in the types' own words, each prefixed by whose it
    is ("GRPO and RFT: ..."). A documented field added to a type brings its key, flag, help and reference row;
    nothing else declares them."""
    fields: list[tuple[str, str, Any]] = [("name", "str", field(default="sft"))]
    said: dict[str, dict[str, list[str]]] = {}  # key -> its documentation -> the objectives it is theirs in
    for kind in kinds:
        written = {k: v for cls in reversed(kind.__mro__) if dataclasses.is_dataclass(cls) for k, v in docs(cls).items()}
        for f in (f for f in dataclasses.fields(kind) if f.init):
            if f.name not in said:
                hint = f.type.__name__ if isinstance(f.type, type) else str(f.type)  # a string under __future__
                listed = hint.startswith("tuple")
                fields.append((f.name, hint if listed or "None" in hint else f"{hint} | None",
                               field(default=() if listed else None)))
            said.setdefault(f.name, {}).setdefault(written.get(f.name, ""), []).append(kind().name.upper())
    section = dataclasses.make_dataclass("ObjectiveKeys", fields, frozen=True)
    section.__module__ = __name__
    section.__doc__ = ("The objective section as users spell it: every key some objective has (flat_section makes "
                       "it from the objective types).")
    section.FIELD_DOCS = {"name": NAME_DOC, **{  # what schema.docs reads for a section made here
        key: "; ".join(f"{' and '.join(whose)}: {text}" for text, whose in by_text.items() if text)
        for key, by_text in said.items()}}
    return section


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
