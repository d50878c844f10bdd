"""Multi-turn GRPO: episodes in an environment (training/grpo/environment.py) instead of single completions.

For each prompt of a step, a group of episodes starts from reset(row)'s opening messages, rendered with the
environment's tools by the run's chat template. Each turn, every live episode of the step samples its next
assistant message in one batched decode (decoding.Turns: each episode's KV cache kept across its turns); its calls are read with the
parser `eval` and the API use (data/toolcalls.parse), each call runs (environment.call: time limit, errors
returned as text) and its result is appended as a tool turn, rendered by the same template; the episode ends
when the model answers without a call, after `max_turns` of its turns, or when the context has no room for
another. The whole context is one training row: the policy's own tokens carry the loss (mask 1); the opening
prompt, the tools and every tool turn are context only (mask 0). Each episode is scored once, finished: the
environment's reward(messages, row), then any --reward on the final answer, weighted; advantages are per
group, as in single-turn GRPO (grpo.advantages), and an episode whose one turn has no call is exactly a
single-turn completion (the same row, mask and advantage).

The rollout of a step is seeded by (seed, epoch, step) as the single-turn sampling is, Python's `random`, numpy's
and torch's in the environment's process included (for tools that draw from them), so a resumed run replays the
same episodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tunebench.core.decision import Decision
from tunebench.core.errors import TunebenchError
from tunebench.data import toolcalls
from tunebench.data.prompts import PromptData, PromptRows
from tunebench.model import decoding
from tunebench.settings.objectives import GRPO
from tunebench.training import grpo
from tunebench.training.grpo import environment as environment_
from tunebench.training.grpo import rewards as rewards_


@dataclass
class Episode:
    key: int  # the prompt (PromptData index) it started from
    messages: list[dict[str, Any]]
    ids: list[int]  # the whole context so far
    mask: list[int]  # 1 on the policy's tokens
    prompt_len: int
    env: environment_.Environment  # what it talks to: its own instance's tools, or the module's shared ones
    turns: int = 0
    calls: int = 0
    calls_ok: int = 0
    stop: str | None = None  # the stop rule that ended it, by name (Stops, or the environment's); None while it plays
    tool_turns: list[tuple[int, int]] = field(default_factory=list)  # (start, end) of each tool turn's tokens
    # the sampling's entropies (watch.py): summed over its tokens, its tokens, summed over its turns' first
    # tokens, its turns recorded
    entropy: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])

    def answer(self) -> str:
        last = self.messages[-1]
        return last["content"] if last["role"] == "assistant" else ""


def template_for(tokenizer, schemas: list[dict], opening: list[dict]) -> Decision | None:
    """The run's chat template for episodes: the model's own where it renders the tools, a call and its result
    whole, else toolcalls.TEMPLATE (set on the tokenizer, so the run saves it and exports carry it). Returns its
    settings row where it changed, None where it did not."""
    probe = [*opening, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": schemas[0]["function"]["name"], "arguments": {"x": "probe"}}}]},
        {"role": "tool", "name": schemas[0]["function"]["name"], "content": "probe result"}]
    if toolcalls.renders_whole(probe, schemas, tokenizer):
        return None
    tokenizer.chat_template = toolcalls.TEMPLATE
    return Decision("chat_template", toolcalls.NAME, "the model's own chat template does not render tool calls and "
                    "their results: Hermes <tool_call> JSON (Qwen2.5's form), saved with the run")


def opening_ids(tokenizer, env: environment_.Environment, messages: list[dict]) -> list[int]:
    text = toolcalls.render(messages, env.schemas, tokenizer, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize(rows, tokenizer, env: environment_.Environment, max_length: int, max_completion_length: int):
    """The openings as data.prompts.PromptData: each rendered with the tools; one that leaves no room for a whole
    turn within max_length is dropped (counted)."""
    ids, kept = [], []
    for k, messages in enumerate(rows.prompts):
        prompt = opening_ids(tokenizer, env, messages)
        if len(prompt) + max_completion_length <= max_length:
            ids.append(prompt)
            kept.append(k)
    if not ids:
        raise TunebenchError(f"no opening of '{rows.source}' (with its tools) leaves room for --max-completion-length "
                             f"{max_completion_length} within --max-length {max_length}; raise --max-length")
    return PromptData(ids, np.asarray(kept, np.int64), len(rows.prompts) - len(ids))


def _tool_turn_ids(tokenizer, env: environment_.Environment, before: list[dict], after: list[dict]) -> list[int]:
    """The tokens that follow the policy's end of turn: the rest of its turn as the template closes it, the tool
    results and the next generation prompt, as the template renders `after` beyond `before`."""
    eos = tokenizer.eos_token
    a = toolcalls.render(before, env.schemas, tokenizer)
    b = toolcalls.render(after, env.schemas, tokenizer, add_generation_prompt=True)
    if not b.startswith(a) or eos not in a:
        raise TunebenchError("the chat template does not render a conversation as a growing text ending each turn "
                             f"with {eos!r}; multi-turn episodes need one that does (leave the template to tunebench)")
    return tokenizer(a[a.rindex(eos) + len(eos):] + b[len(a):], add_special_tokens=False)["input_ids"]


MAX_CALLS = 16  # the calls of one turn that run; more are answered "not run" (a reply of 15,000 calls cost seconds)
MAX_RESTARTS = 32  # the environment's restarts (calls past the limit) in one step before the run stops in one line


def begin(draws: Episodes, key: int) -> Episode:
    """An episode of prompt `key` at its opening. With an ENVIRONMENT class, a new instance's reset(row) sets its
    state, and must open as the row did when the prompts were made (their tokens are the group's shared opening)."""
    opening = draws.openings[draws.on.data.source(key)]
    env = environment_.session(draws.env)
    if env is not draws.env:
        row = draws.on.rows.columns[draws.on.data.source(key)]
        if environment_.opening(env, row) != opening:
            raise TunebenchError(f"--environment {env.path}: reset(row) opened an episode with other messages than "
                                 f"it gave for the same row before ({str(opening)[:120]}); its messages must depend "
                                 "on the row alone (draw the episode's state, not its opening, from `random`)")
    ids = list(draws.on.data.ids[key])
    return Episode(key, [dict(m) for m in opening], ids, [0] * len(ids), len(ids), env)


@dataclass(frozen=True)
class Turn:
    """What a stop rule reads of the turn an episode just took: whether the reply ended (its EOS), the calls it
    made, and once they ran whether their results fit the context (None before)."""

    ended: bool
    calls: list[dict]
    fits: bool | None = None


class Stops:
    """An episode's stop rules, each a method named as the step's stats record it (episodes/stop/NAME), returning
    True to end the episode: BEFORE_CALLS once the reply is in (its calls then never run), AFTER_CALLS once their
    results are, then the environment's own (its STOPS: environment.stopped). `no_room` is also asked before each
    turn, with no turn: a context with no room left for a whole reply."""

    BEFORE_CALLS = ("cut", "answered", "max_turns")
    AFTER_CALLS = ("no_room",)

    def __init__(self, draws: Episodes):
        self.draws = draws

    def cut(self, e: Episode, turn: Turn) -> bool:
        """The reply reached --max-completion-length without ending."""
        return not turn.ended

    def answered(self, e: Episode, turn: Turn) -> bool:
        """The model answered without a call."""
        return not turn.calls

    def max_turns(self, e: Episode, turn: Turn) -> bool:
        """It called on its last turn (--max-turns): the calls are not run, the model would never read them."""
        return e.turns == self.draws.max_turns

    def no_room(self, e: Episode, turn: Turn | None) -> bool:
        """The context has no room for the results its calls gave (they are left out), or, before a turn, for a
        whole reply."""
        if turn is None:
            return len(e.ids) + self.draws.on.s.max_completion_length > self.draws.max_length
        return not turn.fits

    def first(self, names: tuple[str, ...], e: Episode, turn: Turn) -> str | None:
        return next((name for name in names if getattr(self, name)(e, turn)), None)

    def own(self, e: Episode) -> str | None:
        """The environment's own rule that ends the episode now, by name (None without one, or where none fires)."""
        if not e.env.stops:
            return None
        return environment_.stopped(e.env, e.messages, self.draws.on.rows.columns[self.draws.on.data.source(e.key)])


def take_turn(draws: Episodes, e: Episode, reply: list[int]) -> str | None:
    """`reply` appended to `e` (the policy's tokens), its calls run in the episode's environment and their results
    appended as one tool turn (context only); the name of the stop rule that ends the episode with it (Stops), or
    None."""
    tok = draws.on.tokenizer
    e.ids += reply
    e.mask += [1] * len(reply)
    e.turns += 1
    ended = bool(reply) and reply[-1] == tok.eos_token_id
    text, calls = toolcalls.parse(tok.decode(reply[:-1] if ended else reply, skip_special_tokens=False))
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": c} for c in calls]
    before = [*e.messages, message]  # the conversation through this reply, as _tool_turn_ids renders it
    e.messages = list(before)
    why = draws.stops.first(Stops.BEFORE_CALLS, e, Turn(ended, calls))
    if why:
        return why
    started = time.perf_counter()
    for i, c in enumerate(calls):
        result = environment_.call(e.env, c["name"], c["arguments"]) if i < MAX_CALLS else environment_.ToolAnswer(
            f"error: not run: a turn may make at most {MAX_CALLS} calls", False)
        e.calls, e.calls_ok = e.calls + 1, e.calls_ok + result.ok
        e.messages.append({"role": "tool", "name": c["name"], "content": result.text})
        restarts = draws.env.host.restarts - draws.restarts_before
        if restarts > MAX_RESTARTS:
            raise TunebenchError(f"--environment {draws.env.path}: its process was restarted {restarts} times in one "
                                 f"step (each a call past --tool-timeout {draws.env.timeout_s:g} s, or its process "
                                 "ending): a tool that cannot answer stops the run; fix the tool or raise the limit")
    turn = _tool_turn_ids(tok, e.env, before, e.messages)
    draws.rollout_tools_s += time.perf_counter() - started
    why = draws.stops.first(Stops.AFTER_CALLS, e, Turn(ended, calls, len(e.ids) + len(turn) <= draws.max_length))
    if why:
        e.messages = list(before)  # the results the model never reads are not the episode's
        return why
    e.tool_turns.append((len(e.ids), len(e.ids) + len(turn)))
    e.ids += turn
    e.mask += [0] * len(turn)
    return draws.stops.own(e)


def turn_of(e: Episode) -> list[int]:
    """The turn (0 the first) each token after the opening belongs to: a tool turn's tokens count to the turn
    before them (they are not the policy's, and carry no loss)."""
    ends = [end for _, end in e.tool_turns]
    return [sum(end <= p for end in ends) for p in range(e.prompt_len, len(e.ids))]


def states_of(e: Episode) -> list[bytes]:
    """The episode's state at the start of each of its turns: a digest of its whole context then (the opening, or
    everything up to the end of the tool turn before), so turns of a group's episodes share a state exactly when
    their contexts are token-identical (GiGPO's anchor states; grpo.state_advantages)."""
    starts = [e.prompt_len, *(end for _, end in e.tool_turns)]
    return [hashlib.blake2b(np.asarray(e.ids[:s], dtype=np.int64).tobytes(), digest_size=16).digest() for s in starts]


class Episodes(grpo.Drawing):
    """Multi-turn draws (a grpo.Draws): each completion an episode played in the environment (`play`), scored by
    its reward and any --reward on its final answer; its own figures (turns, calls, calls that ran, why it stopped)
    follow the rewards' among the step's stats. The same seeding and rows as single-turn completions, the policy's
    tokens masked in."""

    keep_cache = True  # False: each turn decodes the episodes' whole contexts afresh (the path before Turns)

    def __init__(self, on: grpo.Sampling, env: environment_.Environment, openings: list[list[dict]], max_turns: int,
                 max_length: int):
        self.on, self.env, self.openings, self.max_turns, self.max_length = on, env, openings, max_turns, max_length
        self.weights = torch.tensor([1.0, *(r.weight for r in on.rewards)], dtype=torch.float32)
        self.rollout_prefilled = 0  # the last rollout's context tokens fed to the model (its turns' prefills)
        self.rollout_tools_s = 0.0  # its seconds in the tools and their turns' rendering
        self.restarts_before = 0  # the environment's restarts when this rollout began (rollout: MAX_RESTARTS)
        self.stops = Stops(self)
        self.stop_names = (*grpo.EPISODE_STOPS, *env.stops)  # the built-in rules', then the environment's own
        self.episode_stats = grpo.episode_stats(self.stop_names)

    def score_episodes(self, episodes: list[Episode]) -> tuple[torch.Tensor, list[list[float] | None]]:
        """((episodes, 1 + rewards): the environment's reward, then each --reward on the final answer; each
        episode's per-turn rewards where the environment gave them, their sum in its column)."""
        on = self.on
        columns = [on.rows.columns[on.data.source(e.key)] for e in episodes]
        given = [environment_.score(e.env, e.messages, row, e.turns, i)
                 for i, (e, row) in enumerate(zip(episodes, columns))]
        per_turn = [v if isinstance(v, list) else None for v in given]
        env = [sum(v) if isinstance(v, list) else v for v in given]
        names = on.rows.column_names()
        prompts = [on.tokenizer.decode(on.data.ids[e.key]) for e in episodes]
        answers = [e.answer() for e in episodes]
        per = [r.score(prompts, answers, {n: [c.get(n) for c in columns] for n in names}) for r in on.rewards]
        table = [env, *per]
        return torch.tensor([[torch.nan if v is None else v for v in col] for col in table],
                            dtype=torch.float32).T.reshape(len(episodes), len(table)), per_turn

    def turn_rewards(self, episodes: list[Episode], scores: torch.Tensor, per_turn: list[list[float] | None]
                     ) -> list[dict[int, float]]:
        """Each episode's {turn: weighted reward}: the environment's per-turn rewards (or its one reward, at the
        last turn), the --reward scores of the final answer added at the last turn (grpo.turn_advantages)."""
        out = []
        for e, row, turns in zip(episodes, scores.tolist(), per_turn):
            last = max(e.turns, 1) - 1
            rewards = {t: self.weights[0].item() * r for t, r in enumerate(turns)} if turns is not None else (
                {} if math.isnan(row[0]) else {last: self.weights[0].item() * row[0]})
            answer = [w * v for w, v in zip(self.weights[1:].tolist(), row[1:]) if not math.isnan(v)]
            if answer:
                rewards[last] = rewards.get(last, 0.0) + sum(answer)
            out.append(rewards)
        return out

    @contextlib.contextmanager
    def seeded(self, seed: int) -> Iterator[None]:
        """The draw's random draws seeded by `seed` (Python's, NumPy's and torch's, each put back after, and the
        environment's process's, where the tools draw), its sampling timed."""
        on = self.on
        started, prefill = time.perf_counter(), decoding.PREFILL_S[0]
        state = random.getstate(), np.random.get_state()
        try:
            random.seed(seed)
            np.random.seed(seed % 2**32)
            self.env.host.seed(seed, environment_.CALLBACK_S)  # where the tools draw: the environment's own process
            with torch.random.fork_rng(devices=[on.device] if on.device.type == "cuda" else []):
                torch.manual_seed(seed)
                yield
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])
        on.took(time.perf_counter() - started, decoding.PREFILL_S[0] - prefill, self.rollout_tools_s)

    def play(self, keys: list[int], n: int | None = None, greedy: bool = False) -> list[Episode]:
        """`n` episodes (num_generations unless given) of each prompt of `keys` (consecutive), played to their end,
        sampled at the run's temperature and top-p (greedy: the held-out reward's). Each turn, every episode still
        playing with room for a whole reply samples it in one batched decode (decoding.Turns: each episode's KV
        cache kept across its turns), then `take_turn` runs its calls. Each ends by the first of its stop rules
        (Stops) that fires, recorded by name in `stop`."""
        on = self.on
        n = n or on.s.num_generations
        temperature, top_p = (None, 1.0) if greedy else (on.s.temperature, on.s.top_p)
        placed = on.placed()
        eos, pad = on.tokenizer.eos_token_id, placed.pad_id()
        episodes = [begin(self, k) for k in keys for _ in range(n)]
        turns = decoding.Turns()  # each episode's KV cache, kept across its turns
        self.rollout_prefilled = 0  # the context tokens this rollout fed the model (its turns' prefills)
        self.rollout_tools_s = 0.0  # its seconds in the tools and their turns' rendering
        self.restarts_before = self.env.host.restarts  # the environment's process restarted in this rollout: counted
        for _ in range(self.max_turns):
            for e in episodes:
                if e.stop is None and self.stops.no_room(e, None):
                    e.stop = "no_room"
            playing = [i for i, e in enumerate(episodes) if e.stop is None]
            if not playing:
                break
            contexts = [episodes[i].ids for i in playing]
            with on.eagerly(), decoding.entropies() as recorded, placed.running() as model:
                if self.keep_cache:  # each row fed only past what its cache holds
                    new = turns.decode(model, playing, contexts, on.s.max_completion_length, eos, pad, temperature,
                                       top_p)
                else:
                    new = decoding.decode(model, *decoding.left_padded(contexts, pad, on.device),
                                          on.s.max_completion_length, eos, pad, temperature, top_p)
            replies = grpo.cut_after_eos(new, eos)
            for summed, counted, first in recorded:  # this turn's decode: its rows are `playing`, in order
                for i, h, c, f in zip(playing, summed.tolist(), counted.tolist(), first.tolist()):
                    episodes[i].entropy = [a + b for a, b in zip(episodes[i].entropy, (h, c, f, 1.0))]
            self.rollout_prefilled += turns.prefilled if self.keep_cache else sum(len(episodes[i].ids) for i in playing)
            turns.prefilled = 0
            playing = [episodes[i] for i in playing]
            for e, reply in zip(playing, replies):
                e.stop = take_turn(self, e, reply)
        return episodes

    def scored(self, keys: list[int], episodes: list[Episode]) -> grpo.Drawn:
        """`play`'s episodes of `keys` scored by the environment's reward and the --reward ones, with their figures
        (turns, calls, calls that ran, why each stopped), counted in the sampling's figures."""
        on = self.on
        on.generated_tokens += sum(sum(e.mask) for e in episodes)
        on.prefilled += self.rollout_prefilled
        figures = torch.tensor([[e.turns, e.calls, e.calls_ok, *(float(e.stop == why) for why in self.stop_names)]
                                for e in episodes], dtype=torch.float32)
        started = time.perf_counter()
        scores, per_turn = self.score_episodes(episodes)
        on.times["scoring"] += time.perf_counter() - started
        by_state = getattr(on.s, "turn_credit", "pooled") == "state"  # GiGPO: credit needs every episode's turns
        turns = None if all(t is None for t in per_turn) and not by_state else \
            self.turn_rewards(episodes, scores, per_turn)
        entropy = torch.tensor([[h / max(n, 1), f / max(t, 1)] for h, n, f, t in (e.entropy for e in episodes)]) \
            if any(e.entropy[3] for e in episodes) else None
        return grpo.Drawn([e.ids[e.prompt_len:] for e in episodes], scores,
                          torch.tensor([sum(e.mask) for e in episodes], dtype=torch.float32),
                          torch.tensor([float(e.stop == "cut") for e in episodes]),
                          [e.mask[e.prompt_len:] for e in episodes], figures, turns,
                          turns and [turn_of(e) for e in episodes], entropy,
                          [states_of(e) for e in episodes] if by_state else None)

    def probe_length(self, keys: list[int]) -> int:
        """A whole context (max_length) less the shortest opening of `keys`: the most a step's row holds."""
        return max(self.max_length - len(self.on.data.ids[k]) for k in keys)

    def stat_names(self) -> tuple[str, ...]:
        return (*grpo.stat_names(self.reward_names()), *self.episode_stats)

    def reward_names(self) -> list[rewards_.Reward]:
        return [rewards_.Reward("environment", 1.0, lambda p, c, cols: []), *self.on.rewards]

    def held_out_scores(self, chunks: list[list[int]]) -> list[list[float]]:
        """Each held-out prompt's greedy episode (`chunks` played as one batch each): its row of scores (the
        environment's, then each --reward's), then its turns, calls and calls that ran."""
        rows = []
        for chunk in chunks:
            episodes = self.play(chunk, 1, greedy=True)
            rows += [[*scores, e.turns, e.calls, e.calls_ok]
                     for scores, e in zip(self.score_episodes(episodes)[0].tolist(), episodes)]
        return rows

    def held_out_figures(self, rows: list[list[float]]) -> dict[str, float]:
        """The weighted reward (and each reward's), the share that scored above 0 (success), turns, calls and the
        share of calls that ran, over held_out_scores' rows (all ranks' together)."""
        table = torch.tensor(rows, dtype=torch.float64)
        scores, (turns, calls, ok) = table[:, :-3].float(), table[:, -3:].T
        total = (scores * self.weights).nansum(1)
        names = ["environment", *(r.name for r in self.on.rewards)]
        return {"eval_reward": float(total.mean()),
                **{f"eval_rewards/{n}/mean": float(torch.nanmean(scores[:, j])) for j, n in enumerate(names)},
                "eval_episodes/success": float((total > 0).float().mean()),
                "eval_episodes/turns": float(turns.mean()),
                "eval_episodes/calls": float(calls.mean()),
                "eval_episodes/calls_ok": float(ok.sum() / calls.sum()) if calls.sum() else None}


def play(placed, env: environment_.Environment, records: list[dict[str, Any]], max_turns: int,
         max_new_tokens: int = 64, max_length: int = 2048, batch_size: int = 8, samples: int = 1,
         temperature: float | None = None, seed: int = 0) -> list[Episode]:
    """Greedy episodes of `records` (one each, in order) by a placed model (model.inference.load: a run, an
    adapter, a merged model) in the run's way: the template episodes train in, the same calls and tool turns.
    What a benchmark or a check of an export plays; an opening with no room for a turn is left out (the
    episodes' `key` is its record's index). With a `temperature`, `samples` sampled episodes of each record
    instead (consecutive; torch's draws seeded by `seed`), `batch_size` episodes a decode."""
    rows = PromptRows([environment_.opening(env, r) for r in records], [dict(r) for r in records], env.path)
    template_for(placed.tokenizer, env.schemas, rows.prompts[0])
    data = tokenize(rows, placed.tokenizer, env, max_length, max_new_tokens)
    settings = GRPO(num_generations=1, max_completion_length=max_new_tokens, temperature=temperature or 1.0)
    on = grpo.Sampling(placed.model, placed.tokenizer, data, rows, [], settings, placed.device, placed.autocast_dtype)
    draws = Episodes(on, env, rows.prompts, max_turns, max_length)
    played, each = [], max(1, batch_size // samples)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(seed)
        for start in range(0, len(data), each):
            played += draws.play(list(range(start, min(start + each, len(data)))), samples, greedy=temperature is None)
    for e in played:
        e.key = int(data.source(e.key))
    return played
