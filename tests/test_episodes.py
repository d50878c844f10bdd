"""Multi-turn GRPO in an environment (training/grpo/environment.py, training/grpo/episodes.py): the file's checks, the
episodes' tokens and masks, the tools' failures as turns, and runs from the command line, resumed exactly."""

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_resumed, run_losses
from tunebench.core.errors import TunebenchError
from tunebench.data import toolcalls
from tunebench.interfaces.cli import main
from tunebench.model import decoding
from tunebench.settings.objectives import GRPO
from tunebench.training import grpo
from tunebench.training.grpo import environment, episodes
from tunebench.training.grpo.steps import StepRows

ENV = '''
import time


def look(k: str) -> str:
    """Look a key up.

    Args:
        k: the key
    """
    if k == "boom":
        raise ValueError("no such key")
    if k == "slow":
        time.sleep(5)
        open(__file__ + ".slow-ended", "w").close()  # what the test looks for: the tool's own end
    if k == "long":
        return "x " * 2000
    return {"a": "1", "b": "2"}.get(k, "?")


TOOLS = [look]


def reset(row):
    return [{"role": "user", "content": row["q"]}]


def reward(messages, row):
    return float(messages[-1]["role"] == "assistant" and row["a"] in messages[-1]["content"])
'''


# An environment with state, one instance an episode (ENVIRONMENT): a cart that `add` fills; the reward is whether it
# holds the number of items the row wants. `add("slow")` runs past a short tool timeout.
CART = '''
import time


class Cart:
    def __init__(self):
        self.items = []

    def reset(self, row):
        self.items = list(row.get("start", []))
        return [{"role": "user", "content": row["q"]}]

    def add(self, item: str) -> str:
        """Add.

        Args:
            item: the item
        """
        if item == "slow":
            time.sleep(10)
        self.items.append(item)
        return f"{len(self.items)} item(s)"

    def count(self) -> int:
        """Count."""
        return len(self.items)

    def reward(self, messages, row):
        return float(len(self.items) == row["want"])


ENVIRONMENT = Cart
'''


# The reward of the run that is killed: once the checkpoint KILL_AFTER names is on disk, the next episode scored
# (one of the following step's) kills the training process with SIGKILL (its parent: it runs in the environment's).
KILLER = """def reward(messages, row):
    import os, signal
    if os.path.isdir(os.environ.get("KILL_AFTER", "/nonexistent")):
        os.kill(os.getppid(), signal.SIGKILL)  # the training process: the reward runs in the environment's own"""


def _env(tmp_path, text=ENV, name="env.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"q": f"k {k}?", "a": v}) + "\n" for k, v in [("a", "1"), ("b", "2")] * 4))
    return path


def _train(tmp_path, env, out, *extra):
    return ["train", "--model", "tiny", "--method", "grpo", "--environment", str(env), "--data", str(_rows(tmp_path)),
            "--num-generations", "3", "--max-completion-length", "12", "--max-turns", "3", "--effective-batch-size",
            "2", "--max-steps", "3", "--precision", "fp32", "--no-progress", "--eval-fraction", "0.25",
            "--output-dir", str(out), *extra]


@pytest.mark.parametrize("text, message", [
    (None, "is not a Python file"),
    ("TOOLS = []\ndef reset(row): ...\ndef reward(messages, row): ...\n", "TOOLS must be a non-empty list"),
    ("def f(x):\n    '''F.\n\n    Args:\n        x: x\n    '''\nTOOLS = [f]\ndef reset(row): ...\n"
     "def reward(messages, row): ...\n", "tool 'f' cannot be described to the model .*type hint"),
    (ENV.replace("def reward(messages, row):", "def reward(messages):"), r"reward must take \(messages, row\)"),
    (ENV.replace("def reset(row):", "def start(row):"), "defines no reset"),
    (CART.replace("    def reward(self, messages, row):", "    def score(self, messages, row):"),
     "ENVIRONMENT's instances have no reward method"),
    (CART.replace("def add(", "def _add(").replace("def count(", "def _count("), "ENVIRONMENT has no tools"),
    (CART + "\ndef reset(row): ...\n", "defines ENVIRONMENT and module-level reset"),
    (CART.replace("ENVIRONMENT = Cart", "ENVIRONMENT = Cart()"), "ENVIRONMENT must be a class"),
    (CART.replace("self.items = []", "self.items = 1 / 0"), r"ENVIRONMENT\(\) raised ZeroDivisionError"),
])
def test_a_bad_environment_is_refused_in_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, text,
                                                                          message):
    from tunebench.jobs.parts import finetune_model

    monkeypatch.setattr(finetune_model, "load", lambda *a: pytest.fail("the model loaded"))
    env = _env(tmp_path, text) if text is not None else tmp_path / "missing.py"
    assert main(_train(tmp_path, env, tmp_path / "out")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not (tmp_path / "out").exists()


def test_max_turns_is_one_or_more_and_belongs_to_an_environment(tmp_path, capsys):
    assert main(_train(tmp_path, _env(tmp_path), tmp_path / "out", "--max-turns", "0")) == 2
    assert "--max-turns must be 1 or more" in capsys.readouterr().err
    assert main(["train", "--model", "tiny", "--method", "grpo", "--reward", "exact", "--max-turns", "2", "--data",
                 str(_rows(tmp_path))]) == 2
    assert "--max-turns and --tool-timeout set episodes in an environment" in capsys.readouterr().err
    assert main(["train", "--model", "tiny", "--method", "grpo", "--reward", "exact", "--turn-credit", "state",
                 "--data", str(_rows(tmp_path))]) == 2
    assert "--turn-credit state compares the turns of episodes" in capsys.readouterr().err
    assert main(["train", "--model", "tiny", "--method", "grpo", "--reward", "exact", "--turn-credit", "states",
                 "--data", str(_rows(tmp_path))]) == 2
    assert "pooled" in capsys.readouterr().err


def _decoded(rows: list[list[int]], eos: int, pad: int) -> torch.Tensor:
    """Token lists as a decode returns them: padding after each row's EOS; a row without one (cut at the token
    limit) is the widest, as decoding makes it."""
    width = max(map(len, rows))
    assert all(eos in r or len(r) == width for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows])


def _scripted(tok, replies):
    """decoding.Turns.decode (an episode turn's decode) that answers each live episode, turn after turn, with the next of
    its `replies` texts."""
    turn = {"n": 0}

    def decode(self, model, rows, contexts, max_new_tokens, eos, pad, temperature=None, top_p=1.0):
        texts = replies[turn["n"]]
        turn["n"] += 1
        return _decoded([tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in texts[:len(contexts)]], eos, pad)

    return decode


def _sampler(tmp_path, tiny, max_turns=3, timeout_s=10.0, text=ENV, rows=None, max_length=1024):
    """Episodes of `text`'s environment. Its calls answer in milliseconds; the default limit is for calls that must
    succeed, so it is far from any machine's speed (a loaded CI worker stalls a process for seconds); the tests of a
    limit that must fire pass their own, below the tool's sleep."""
    from tunebench.data.prompts import PromptRows

    tok = tiny.tokenizer
    env = environment.load(str(_env(tmp_path, text)), timeout_s)
    rows = rows or [{"q": "k a?", "a": "1"}, {"q": "k boom?", "a": "?"}]
    prompts = PromptRows([environment.opening(env, r) for r in rows], rows, "rows")
    episodes.template_for(tok, env.schemas, prompts.prompts[0])
    data = episodes.tokenize(prompts, tok, env, max_length, 12)  # scripted replies: no model reads these contexts
    settings = GRPO(num_generations=2, max_completion_length=12, loss_type="dapo")
    on = grpo.Sampling(tiny.model, tok, data, prompts, [], settings, torch.device("cpu"))
    return episodes.Episodes(on, env, prompts.prompts, max_turns, max_length)


def test_an_episode_trains_only_the_policys_tokens_and_renders_as_the_template_does(tmp_path, tiny, monkeypatch):
    """A call, its result, an answer: the row is the template's rendering of the conversation token for token;
    the mask covers the two replies the policy wrote and nothing of the tools, the prompt or the tool turn."""
    sampler = _sampler(tmp_path, tiny)
    tok = tiny.tokenizer
    call = toolcalls.written("look", {"k": "a"})
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [[call, call], ["It is 1.", "It is 2."]]))
    first, second = sampler.play([0], 2)
    assert [m["role"] for m in first.messages] == ["user", "assistant", "tool", "assistant"]
    assert first.messages[2]["content"] == "1" and first.answer() == "It is 1." and (first.turns, first.calls) == (2, 1)
    rendered = toolcalls.render(first.messages, sampler.env.schemas, tok)
    assert rendered == tok.decode(first.ids) + "\n"  # the template closes the last turn with a newline
    policy = [t for t, m in zip(first.ids, first.mask) if m]
    eos = tok.eos_token
    assert tok.decode(policy) == f"{call}{eos}It is 1.{eos}"
    assert first.mask[:first.prompt_len] == [0] * first.prompt_len
    (start, end), = first.tool_turns
    assert set(first.mask[start:end]) == {0} and "<tool_response>\n1\n</tool_response>" in tok.decode(first.ids[start:end])
    assert sampler.score_episodes([first, second])[0].flatten().tolist() == [1.0, 0.0]


def test_a_failed_call_is_a_turn_the_episode_goes_on_from(tmp_path, tiny, monkeypatch):
    sampler = _sampler(tmp_path, tiny)  # no call here may time out
    tok = tiny.tokenizer
    calls = [toolcalls.written("look", {"k": "boom"}), toolcalls.written("look", {"k": 7}),
             toolcalls.written("nope", {})]
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [calls, ["a", "b", "c"]]))
    done = sampler.play([1], 3)
    answers = [e.messages[2]["content"] for e in done]
    assert answers[0] == "error: ValueError: no such key" and "do not fit look's parameters" in answers[1]
    assert "no tool named 'nope'" in answers[2]
    assert all(e.turns == 2 and e.calls == 1 and e.calls_ok == 0 and e.answer() for e in done)


def test_a_turn_runs_at_most_max_calls_and_a_step_of_restarts_stops_the_run_in_one_line(tmp_path, tiny, monkeypatch):
    """N5: the calls of one reply past MAX_CALLS are answered "not run" (15,000 in one reply cost seconds), and an
    environment restarted more than MAX_RESTARTS times in a step (each a call past its limit) stops the run."""
    tok = tiny.tokenizer
    monkeypatch.setattr(episodes, "MAX_CALLS", 2)
    many = "".join(toolcalls.written("look", {"k": k}) for k in "abab")
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [[many], ["done"]]))
    e, = _sampler(tmp_path, tiny).play([0], 1)
    assert [m["content"] for m in e.messages if m["role"] == "tool"] == [
        "1", "2", *["error: not run: a turn may make at most 2 calls"] * 2] and (e.calls, e.calls_ok) == (4, 2)
    monkeypatch.setattr(episodes, "MAX_RESTARTS", 1)
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [[toolcalls.written("look", {"k": "slow"})] * 2]))
    with pytest.raises(TunebenchError, match="its process was restarted 2 times in one step"):
        _sampler(tmp_path, tiny, timeout_s=0.5).play([0], 2)


def test_results_that_do_not_fit_the_context_end_the_episode_unread(tmp_path, tiny, monkeypatch):
    sampler = _sampler(tmp_path, tiny)
    tok = tiny.tokenizer
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [[toolcalls.written("look", {"k": "long"})]]))
    e, = sampler.play([0], 1)
    assert (e.turns, e.calls, e.tool_turns) == (1, 1, []) and len(e.ids) <= sampler.max_length
    assert e.messages[-1]["role"] == "assistant" and sum(e.mask) == len(e.ids) - e.prompt_len


def test_each_episode_records_why_it_stopped(tmp_path, tiny, monkeypatch):
    """The four stop rules, one episode each: an answer without a call, a reply cut at --max-completion-length (no
    EOS), a call on the last of --max-turns (not run), results with no room in the context (not read); the step's
    stats give each rule's share."""
    sampler = _sampler(tmp_path, tiny, max_turns=2)
    tok = tiny.tokenizer
    call, long_call = toolcalls.written("look", {"k": "a"}), toolcalls.written("look", {"k": "long"})
    first = ["It is 1.", "x", call, long_call]

    def decode(self, model, rows, contexts, max_new_tokens, eos, pad, temperature=None, top_p=1.0):
        if len(contexts) == 4:  # the first turn: episode 1's reply has no EOS, as when the token limit cuts it
            replies = [tok(t, add_special_tokens=False)["input_ids"] + [eos] for t in first]
            replies[1] = replies[1][:1] * max(map(len, replies))  # the widest: decoding pads the others
            return _decoded(replies, eos, pad)
        return _decoded([tok(call, add_special_tokens=False)["input_ids"] + [eos]], eos, pad)  # episode 2's second

    monkeypatch.setattr(decoding.Turns, "decode", decode)
    sampler.on.s = GRPO(num_generations=4, max_completion_length=12, loss_type="dapo")
    played = sampler.play([0], 4)
    assert [e.stop for e in played] == ["answered", "cut", "max_turns", "no_room"]
    assert [(e.turns, e.calls) for e in played] == [(1, 0), (1, 0), (2, 1), (1, 1)]
    monkeypatch.setattr(episodes.Episodes, "play", lambda self, *a, **k: played)
    groups = StepRows(sampler).groups_of([0], sampler.draw([0], seed=1))
    names = sampler.stat_names()[1:]  # the row stats: every stat but kl
    shares = {n: groups.row_stats[:, names.index(n)].tolist() for n in names if n.startswith("episodes/stop/")}
    assert shares == {"episodes/stop/answered": [1, 0, 0, 0], "episodes/stop/cut": [0, 1, 0, 0],
                      "episodes/stop/max_turns": [0, 0, 1, 0], "episodes/stop/no_room": [0, 0, 0, 1]}


def test_an_episode_opens_with_its_own_rows_messages_when_an_opening_is_dropped(tmp_path, tiny, monkeypatch):
    """An opening too long for a turn is dropped at tokenizing: the next prompt's episodes still carry their own
    row's messages (they took the dropped row's, by index into the rows, and the reward read another question)."""
    rows = [{"q": "k " + "a " * 600 + "?", "a": "1"}, {"q": "k b?", "a": "2"}]
    sampler = _sampler(tmp_path, tiny, rows=rows)
    assert sampler.on.data.dropped == 1 and sampler.on.data.source(0) == 1
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tiny.tokenizer, [["It is 2."]]))
    e, = sampler.play([0], 1)
    assert e.messages[0]["content"] == "k b?" and sampler.score_episodes([e])[0].flatten().tolist() == [1.0]


def test_a_stateful_environment_gives_each_episode_its_own_instance(tmp_path, tiny, monkeypatch):
    """ENVIRONMENT's episodes each fill their own cart (reset sets it from the row; the reward reads it). A call past
    its limit restarts the environment's process: the carts of the episodes still playing are lost with it, said
    to the model in their next call and scored None (no opinion), never another episode's cart read instead."""
    # 5 s: the quick calls' room on a loaded machine (they answer in milliseconds); the slow one sleeps 10
    sampler = _sampler(tmp_path, tiny, timeout_s=5.0, text=CART, rows=[{"q": "Add one.", "want": 1, "start": []}])
    tok = tiny.tokenizer
    pen = toolcalls.written("add", {"item": "pen"})
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [[pen, pen], [pen, "Done."], ["Done."]]))
    one, two = sampler.play([0], 2)
    assert [m["content"] for m in one.messages if m["role"] == "tool"] == ["1 item(s)", "2 item(s)"]
    assert [m["content"] for m in two.messages if m["role"] == "tool"] == ["1 item(s)"]  # its own cart
    assert sampler.score_episodes([one, two])[0].flatten().tolist() == [0.0, 1.0]
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [[toolcalls.written("add", {"item": "slow"}), pen],
                                                          ["Done.", "Done."]]))
    slow, lost = sampler.play([0], 2)
    assert "no answer within 5 s" in slow.messages[2]["content"]
    # the other episode's cart went with the restart (its call came after the slow one's): its call says so
    assert [m["content"] for m in lost.messages if m["role"] == "tool"] == [f"error: {environment.LOST}"]
    scores = sampler.score_episodes([slow, lost])[0].flatten().tolist()
    assert all(math.isnan(v) for v in scores), scores
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [[toolcalls.written("count", {})], ["Done."]]))
    after, = sampler.play([0], 1)  # the next step's episode: a cart of the new process
    assert after.messages[2]["content"] == "0" and sampler.score_episodes([after])[0].flatten().tolist() == [0.0]


def _cart_train(tmp_path, out, n_rows, *extra, stops=False):
    """A 2-step GRPO command in CART with its count tool left out (the tiny model's 512 positions hold one tool's
    schema and 3 turns, not two), on `n_rows` rows wanting 1 or 2 items; with `stops`, a stop rule of its own
    (`full`: the cart holds what the row wants)."""
    one_tool = CART.replace('    def count(self) -> int:\n        """Count."""\n        return len(self.items)\n', "")
    assert one_tool != CART
    if stops:
        one_tool = one_tool.replace("    def reward(self, messages, row):", "    STOPS = ['full']\n\n"
                                    "    def full(self, messages, row):\n        return len(self.items) >= row['want']\n\n"
                                    "    def reward(self, messages, row):")
    rows = tmp_path / "carts.jsonl"
    rows.write_text("".join(json.dumps({"q": f"Add {n}.", "want": n}) + "\n" for n in (1, 2) * (n_rows // 2)))
    args = _train(tmp_path, _env(tmp_path, one_tool), out, "--max-steps", "2", *extra)
    args[args.index("--data") + 1] = str(rows)
    return args


def test_an_environments_own_stop_rule_ends_an_episode_by_name(tmp_path, tiny, monkeypatch):
    """Issue 97: each stop rule a named method (episodes.Stops: the built-in ones, in the stats' names), and an
    environment adds its own (STOPS, run in its process once a turn's results are in); the one that ended each
    episode is recorded by name and counted in the step's stats. A rule that is no function of (messages, row) in
    the file, or that takes a built-in rule's or a tool's name, is refused when the file loads."""
    assert set(episodes.Stops.BEFORE_CALLS + episodes.Stops.AFTER_CALLS) == set(grpo.EPISODE_STOPS)
    assert all(callable(getattr(episodes.Stops, name)) for name in grpo.EPISODE_STOPS)
    solved = ENV + ('\ndef solved(messages, row):\n'
                    '    return messages[-1]["role"] == "tool" and messages[-1]["content"] == row["a"]\n\n'
                    'STOPS = [solved]\n')
    sampler = _sampler(tmp_path, tiny, text=solved)
    tok = tiny.tokenizer
    calls = [toolcalls.written("look", {"k": "a"}), toolcalls.written("look", {"k": "b"})]
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [calls, ["It is 1."]]))
    drawn = sampler.draw([0], seed=1)  # row 0 wants "1": look(a) answers it, look(b) does not
    names = sampler.stat_names()
    assert names[-5:] == tuple(f"episodes/stop/{why}" for why in (*grpo.EPISODE_STOPS, "solved"))
    stops = drawn.figures[:, -5:].tolist()
    assert stops == [[0, 0, 0, 0, 1], [1, 0, 0, 0, 0]]  # the first ended by `solved` after one turn, the other answered
    assert drawn.figures[:, 0].tolist() == [1.0, 2.0]
    for text, message in (("def answered(messages, row):\n    return True\nSTOPS = [answered]\n", "already used"),
                          ("STOPS = [look]\n", "already used"),
                          ("STOPS = 'solved'\n", "must be a list"),
                          ("STOPS = [len]\n", "not a function defined in the file"),
                          ("def one(messages):\n    return True\nSTOPS = [one]\n", r"must take \(messages, row\)")):
        with pytest.raises(TunebenchError, match=message):
            environment.load(str(_env(tmp_path, ENV + "\n" + text)), 1.0)


def test_a_stateful_environment_trains_from_the_command_line(tmp_path):
    """Two GRPO steps on the tiny model in ENVIRONMENT's carts (add only); the step logs why its episodes stopped."""
    out = tmp_path / "out"
    args = _cart_train(tmp_path, out, 6, stops=True)
    assert main(args) == 0
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # the environment's own stop rule among the step's stops
        stops = [r[f"episodes/stop/{why}"] for why in (*grpo.EPISODE_STOPS, "full")]
        assert sum(stops) == pytest.approx(1.0) and "rewards/environment/mean" in r


def _frames_below_the_job(run, job_file: str) -> dict[str, int]:
    """The most tunebench frames between a job's entry (its `run`, counted) and a model call inside the optimizer steps,
    by kind: a decode (the policy sampling: model/decoding.py on the way) or a training forward (gradients on), as
    `run()` makes them; a forward pre-hook on every PreTrainedModel reads the stack."""
    from transformers import PreTrainedModel

    import tunebench

    package = str(Path(tunebench.__file__).resolve().parent) + os.sep
    most = {"decode": 0, "training forward": 0}

    def hook(module, args):
        if not isinstance(module, PreTrainedModel):
            return
        chain, frame = [], sys._getframe(1)
        while frame is not None and not (frame.f_code.co_filename.endswith(job_file) and frame.f_code.co_name == "run"):
            if frame.f_code.co_filename.startswith(package):
                chain.append(frame.f_code.co_filename[len(package):])
            frame = frame.f_back
        if frame is None or not any(c.endswith("loop.py") for c in chain):  # outside the steps: measuring, eval
            return
        kind = "decode" if any(c.endswith("decoding.py") for c in chain) else \
            "training forward" if torch.is_grad_enabled() else None
        if kind:
            most[kind] = max(most[kind], len(chain) + 1)  # the job's own frame counted, as issue 97 measured

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        run()
    finally:
        handle.remove()
    return most


def test_a_decode_runs_at_most_eight_tunebench_frames_below_the_job_and_a_training_forward_five(tmp_path):
    """Issue 97 item 3, measured by running: a GRPO step's decode was 14 tunebench frames below the job at its prefill
    and 15 at each decoding step (the step ran inside the batch feeder: loop -> _produce -> next_micro_batch -> the
    job's begin_step callback -> draw -> rollout -> grpo.complete -> Placed.decode_turns -> Turns.decode); a
    training forward 6 (GRPO) and 5 (SFT). Now the step is a stage the loop asks for (grpo/steps.py), the loop is
    called from recipe.run, and the step plays the draw itself (seeded, play, scored): an episode's decode 7 at its
    prefill and 8 at each decoding step, a completion's 8 (decoding's sampling loop and its cache's step are two
    frames of their own), a training forward 5 (GRPO) and 4 (SFT)."""
    episodes_run = _frames_below_the_job(lambda: main(_cart_train(tmp_path, tmp_path / "grpo", 6, "--max-steps", "1",
                                                                  "--eval-fraction", "0")), os.path.join("jobs", "grpo.py"))
    assert 0 < episodes_run["decode"] <= 8 and 0 < episodes_run["training forward"] <= 5, episodes_run
    prompts = tmp_path / "q.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"{a} plus 1?", "answer": f"#### {a + 1}"}) + "\n"
                               for a in range(8)))
    completions_run = _frames_below_the_job(lambda: main([
        "train", "--model", "tiny", "--method", "grpo", "--reward", "format:\\d", "--data", str(prompts),
        "--num-generations", "2", "--max-completion-length", "6", "--effective-batch-size", "2", "--max-steps", "1",
        "--precision", "fp32", "--no-progress", "--eval-fraction", "0", "--output-dir", str(tmp_path / "completions")]),
        os.path.join("jobs", "grpo.py"))
    assert 0 < completions_run["decode"] <= 8, completions_run
    rows = tmp_path / "sft.jsonl"
    rows.write_text("".join(json.dumps({"instruction": f"q{i}", "response": "a"}) + "\n" for i in range(8)))
    sft = _frames_below_the_job(lambda: main(["train", "--model", "tiny", "--data", str(rows), "--max-steps", "1",
                                              "--precision", "fp32", "--no-progress", "--eval-fraction", "0",
                                              "--output-dir", str(tmp_path / "sft")]), os.path.join("jobs", "finetune.py"))
    assert 0 < sft["training forward"] <= 4 and sft["decode"] == 0, sft


# Each rank's draws as it drew them: Episodes.seeded and .scored wrapped in every process of a run (PYTHONPATH's
# sitecustomize), one line a draw (the rank, its seed, the episodes' tokens) in the file TUNEBENCH_TEST_DRAWS names.
DRAWS_LOG = """
import os

if os.environ.get("TUNEBENCH_TEST_DRAWS") and os.environ.get("RANK") is not None:
    import json

    from tunebench.training.grpo import episodes

    seeded, scored, seeds = episodes.Episodes.seeded, episodes.Episodes.scored, []

    def seeding(self, seed):
        seeds.append(seed)
        return seeded(self, seed)

    def logged(self, keys, played):
        drawn = scored(self, keys, played)
        with open(os.environ["TUNEBENCH_TEST_DRAWS"], "a") as f:
            f.write(json.dumps({"rank": int(os.environ["RANK"]), "seed": seeds[-1], "episodes": drawn.completions})
                    + "\\n")
        return drawn

    episodes.Episodes.seeded, episodes.Episodes.scored = seeding, logged
"""


def test_episodes_train_on_two_ranks_each_drawing_episodes_of_its_own(tmp_path, monkeypatch):
    """Episodes under torchrun: each rank plays its own prompts' groups (each in its own ENVIRONMENT instances),
    the step's figures summed over the ranks, the held-out episodes shared; two steps end to end. Every row asks
    the same, so the two ranks open every step on the same prompt: what each drew (logged where it drew it) differs
    only because each rank samples with a seed of its own; the same seed would draw the same episodes twice."""
    from test_distributed import _tunebench

    out, log = tmp_path / "out", tmp_path / "draws.jsonl"
    args = _cart_train(tmp_path, out, 8, "--batch-size", "1")
    (tmp_path / "carts.jsonl").write_text((json.dumps({"q": "Add 1.", "want": 1}) + "\n") * 8)
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "sitecustomize.py").write_text(DRAWS_LOG)
    monkeypatch.setenv("TUNEBENCH_TEST_DRAWS", str(log))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "policy"), os.environ.get("PYTHONPATH", "")]))
    _tunebench(args, nproc=2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2 and "eval_episodes/success" in summary
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(abs(sum(r[f"episodes/stop/{why}"] for why in grpo.EPISODE_STOPS) - 1) < 1e-6 for r in steps)
    draws = [json.loads(line) for line in log.read_text().splitlines()]
    by_rank = {rank: [d for d in draws if d["rank"] == rank] for rank in (0, 1)}
    assert len(by_rank[0]) == len(by_rank[1]) >= 2  # a step's draw (and any refill's) on each rank
    for mine, theirs in zip(by_rank[0], by_rank[1], strict=True):
        assert mine["seed"] != theirs["seed"] and mine["episodes"] != theirs["episodes"]


def test_one_turn_episodes_are_single_turn_grpos_rows(tmp_path, tiny, monkeypatch):
    """Episodes that answer at once: each row is the opening and the reply with the loss on the whole reply, as
    grpo.rows_of makes a single-turn completion's, and the group's advantages are grpo.advantages of the scores."""
    sampler = _sampler(tmp_path, tiny)
    tok = tiny.tokenizer
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [["It is 1.", "no"]]))
    groups = StepRows(sampler).groups_of([0], sampler.draw([0], seed=1))
    replies = [tok("It is 1.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id],
               tok("no", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    single = grpo.Groups([0], replies, *grpo.advantages(torch.tensor([[1.0], [0.0]]), torch.ones(1), 2, "group")[:1],
                         groups.row_stats)
    theirs, ours = (grpo.rows_of(g, [0], sampler.on.data, 2, tok.pad_token_id) for g in (single, groups))
    for key in ("input_ids", "labels", "advantages", "counts"):
        assert torch.equal(theirs[key], ours[key]), key


# A policy that calls: each reply drawn with torch's generator (seeded by the step, as sampling is) from the context
# alone, the call look(k="a") until its result is in the context, else (or 30% of the time) an answer; the random
# tiny model itself almost never writes a whole call, so a resume would replay no tool turn. Loaded in the test's
# process, and as the killed run's sitecustomize (PYTHONPATH) in its own.
SCRIPTED_POLICY = """
import os

if os.environ.get("TUNEBENCH_TEST_POLICY"):
    import torch

    from tunebench.data import toolcalls
    from tunebench.model import decoding
    from tunebench.training import grpo

    CALL = toolcalls.written("look", {"k": "a"})
    TOKENIZER = []
    placed = grpo.Sampling.placed

    def placing(self):  # the episodes' tokenizer, for the scripted turns below
        TOKENIZER[:] = [self.tokenizer]
        return placed(self)

    def decode(self, model, rows, contexts, max_new_tokens, eos, pad, temperature=None, top_p=1.0):
        tokenizer, out = TOKENIZER[0], []
        for ids in contexts:
            called = CALL in tokenizer.decode(ids)
            text = "It is 1." if called or float(torch.rand(())) < 0.3 else CALL
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"] + [eos])
        width = max(map(len, out))
        return torch.tensor([r + [pad] * (width - len(r)) for r in out])

    grpo.Sampling.placed, decoding.Turns.decode = placing, decode
"""


def test_grpo_in_an_environment_from_the_command_line_logs_its_episodes_and_resumes_after_kill_9(tmp_path, capsys,
                                                                                                 monkeypatch):
    """Three steps of episodes (a scripted policy's, SCRIPTED_POLICY: most episodes call a tool), and the same run
    killed with SIGKILL in step 3's episodes (its environment's reward kills its own process once step 2's
    checkpoint is on disk: no handler, no flush, as kill -9 leaves it) and resumed: the same rewards, turns, calls
    and losses; each step logs its episodes, the summary the held-out ones."""
    import importlib.util

    one, killed = tmp_path / "one", tmp_path / "killed"
    env = _env(tmp_path, ENV.replace("def reward(messages, row):", KILLER))
    policy = tmp_path / "policy" / "sitecustomize.py"
    policy.parent.mkdir()
    policy.write_text(SCRIPTED_POLICY)
    monkeypatch.setenv("TUNEBENCH_TEST_POLICY", "1")
    monkeypatch.setattr(grpo.Sampling, "placed", grpo.Sampling.placed)  # put back after the test
    monkeypatch.setattr(decoding.Turns, "decode", decoding.Turns.decode)
    spec = importlib.util.spec_from_file_location("scripted_policy", policy)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # the script's turns here
    assert main(_train(tmp_path, env, one, "--save-steps", "1")) == 0
    printed = capsys.readouterr().out
    assert "rewards: environment x 1; environment" in printed and "tools look" in printed
    assert "3 episodes a prompt in" in printed and "up to 3 turns of up to 12 tokens" in printed
    assert "held-out reward before training:" in printed and "succeeded" in printed
    assert "each credit below 0 x 0.5 (--negative-weight; 0.5 unless given with --environment" in printed  # default
    assert json.loads((one / "user_code.json").read_text()) == {str(env.resolve()): environment.UserFile.read(
        env).sha256}  # what a resume, checkpoint or none, is held to
    command = [sys.executable, "-m", "tunebench", *_train(tmp_path, env, killed, "--save-steps", "1")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "KILL_AFTER": str(killed / "checkpoints" / "step-00000002"),
                               "PYTHONPATH": os.pathsep.join([str(policy.parent), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert [p.name for p in sorted((killed / "checkpoints").glob("step-*"))][-1] == "step-00000002"
    capsys.readouterr()
    assert main(_train(tmp_path, env, killed, "--save-steps", "1", "--resume", "auto")) == 0
    assert_resumed(killed, 2, capsys.readouterr().out)
    rows = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert {"episodes/turns", "episodes/calls", "frac_reward_zero_std", "rewards/environment/mean"} <= set(rows[0])
    theirs = {r["step"]: r for r in (json.loads(line) for line in (killed / "metrics.jsonl").read_text().splitlines())
              if "loss" in r}
    assert sorted(theirs) == [1, 2, 3]
    assert sum(r["episodes/calls"] for r in rows) > 0 and sum(theirs[s]["episodes/calls"] for s in (2, 3)) > 0
    for r in rows:
        for key in ("reward", "episodes/turns", "episodes/calls", "completions/mean_length"):
            assert theirs[r["step"]][key] == pytest.approx(r[key], abs=1e-6), (r["step"], key)
    assert run_losses(killed) == pytest.approx(run_losses(one), rel=1e-4, abs=1e-6)
    summary = json.loads((one / "summary.json").read_text())
    assert {"eval_episodes/success", "eval_episodes/success_before", "eval_episodes/turns"} <= set(summary)
    assert set(summary["sampling_split_s"]) == {"prefill", "decode", "tools", "scoring"}
    assert summary["sampling_split_s"]["tools"] > 0  # the script decodes nothing: its time is the tools' (the
    # decode's and prefill's parts of a sampled rollout: test_grpo's CLI run, and the kept-cache rollout test here)
    assert main(["report", str(one)]) == 0  # the run's report draws the episodes' turns and calls
    assert "GRPO in an environment: turns and tool calls" in (one / "report" / "report.md").read_text()
    assert (one / "report" / "grpo_episodes.png").is_file()


@pytest.mark.usefixtures("children_in_process")
def test_compare_puts_two_environments_runs_side_by_side(tmp_path):
    """A matrix of one GRPO run in each of two environments: each results row names its environment and holds its
    held-out episodes' figures before and after, and the report sets them side by side."""
    from tunebench.jobs import compare, report

    strict = _env(tmp_path, name="strict.py")
    lenient = _env(tmp_path, ENV.replace('row["a"] in messages[-1]["content"]', "True"), name="lenient.py")
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(  # the base is a whole run (the lenient environment's); the strict run changes the file
        f"base: {{model.name: tiny, data.path: '{_rows(tmp_path)}', objective.name: grpo, objective.num_generations: 3, "
        f"objective.max_completion_length: 12, objective.environment: '{lenient}', objective.max_turns: 2, "
        "train.effective_batch_size: 2, train.max_steps: 1, hardware.precision: fp32, data.eval_fraction: 0.25, "
        "train.compile: 'off'}\n"
        f"experiments:\n  - {{name: strict, set: {{objective.environment: '{strict}'}}}}\n  - {{name: lenient}}\n")
    out = tmp_path / "results.csv"
    compare.run(str(matrix), str(out), str(tmp_path / "runs"), 1, {})
    with out.open() as f:
        rows = {r["experiment"]: r for r in csv.DictReader(f)}
    assert {r["status"] for r in rows.values()} == {"ok"}, [r["message"] for r in rows.values()]
    assert rows["strict"]["environment"] == str(strict) and rows["lenient"]["environment"] == str(lenient)
    assert float(rows["lenient"]["episode_success"]) == 1.0  # every episode that ends in an answer scores 1
    for r in rows.values():
        summary = json.loads((tmp_path / "runs" / f"{r['experiment']}-cpu-r1" / "summary.json").read_text())
        assert float(r["episode_success_before"]) == summary["eval_episodes/success_before"]
        assert float(r["reward"]) == pytest.approx(summary["eval_reward"])
        assert float(r["episode_turns"]) == pytest.approx(summary["eval_episodes/turns"])
    text = (report.write([str(out)], str(tmp_path / "report")).parent / "report.md").read_text()
    section = text.split("## Held-out reward (GRPO), before training and after")[1].split("##")[0]
    assert str(strict) in section and str(lenient) in section and "| 100% |" in section


def test_a_rollout_keeping_each_episodes_cache_draws_what_decoding_whole_contexts_draws(tmp_path, tiny):
    """The tiny model's own sampled episodes (fp32, one seed): with each episode's KV cache kept across turns
    (decoding.Turns, the default) the step draws the same tokens, scores and stops as decoding every turn's whole
    contexts afresh, and feeds the model fewer context tokens (a group's opening once)."""
    drawn = {}
    for keep in (True, False):
        sampler = _sampler(tmp_path, tiny)
        sampler.keep_cache = keep
        drawn[keep] = (sampler.draw([0, 1], seed=3), sampler.on.prefilled)
    (cached, fed_cached), (whole, fed_whole) = drawn[True], drawn[False]
    assert cached.completions == whole.completions and torch.equal(cached.figures, whole.figures)
    assert torch.equal(cached.scores.nan_to_num(-1), whole.scores.nan_to_num(-1))
    assert 0 < fed_cached < fed_whole


def test_per_turn_rewards_reach_their_turns_tokens_as_the_grpo_papers_process_supervision(tmp_path, tiny,
                                                                                           monkeypatch):
    """An environment's reward returning one number per turn: the group's rewards are normalized together and
    each policy token gets the sum of its turn's and the later turns' (the GRPO paper's process supervision); the
    tool turn's tokens carry nothing. A group of one-number rewards gets grpo.advantages' figures."""
    per_turn = ENV.replace('''    return float(messages[-1]["role"] == "assistant" and row["a"] in messages[-1]["content"])''',
                           '''    turns = sum(m["role"] == "assistant" for m in messages)
    return [0.5] * (turns - 1) + [float(row["a"] in messages[-1]["content"])]''')
    sampler = _sampler(tmp_path, tiny, text=per_turn)
    tok = tiny.tokenizer
    call = toolcalls.written("look", {"k": "a"})
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [[call, "no"], ["It is 1."]]))
    drawn = sampler.draw([0], seed=1)
    assert drawn.turn_rewards == [{0: 0.5, 1: 1.0}, {0: 0.0}] and drawn.scores[:, 0].tolist() == [1.5, 0.0]
    pool = torch.tensor([0.5, 1.0, 0.0], dtype=torch.float64)
    norm = ((pool - pool.mean()) / (pool.std() + 1e-4)).tolist()
    expected = [[norm[0] + norm[1], norm[1]], [norm[2]]]
    got = grpo.turn_advantages(drawn.turn_rewards, 2, "group")
    assert [len(a) for a in got] == [2, 1] and sum(got, []) == pytest.approx(sum(expected, []))
    groups = StepRows(sampler).groups_of([0], drawn)
    batch = grpo.rows_of(groups, [0], sampler.on.data, 2, tok.pad_token_id)
    targets = batch["labels"][:, 1:] != -100
    first = [batch["token_advantages"][0][targets[0]].tolist(), batch["token_advantages"][1][targets[1]].tolist()]
    reply = len(tok(call, add_special_tokens=False)["input_ids"]) + 1  # the call and its EOS: turn one
    assert first[0] == pytest.approx([expected[0][0]] * reply + [expected[0][1]] * (len(first[0]) - reply))
    assert first[1] == pytest.approx([expected[1][0]] * len(first[1]))
    from tunebench.training.objective import prepare

    ready, _, _ = prepare(batch, torch.device("cpu"))  # the loss reads the tokens' own advantages
    loss = grpo.GRPOLoss(tiny.model, sampler.on.s, sampler.reward_names(), episode_stats=sampler.episode_stats)
    doubled = dict(ready, token_advantages=2 * ready["token_advantages"])
    with torch.no_grad():
        assert abs(float(loss(ready)[0])) > 1e-3
        assert float(loss(doubled)[0]) == pytest.approx(2 * float(loss(ready)[0]), rel=1e-5)
    scalar = [{0: 1.0}, {0: 0.0}, {2: 0.25}, {1: 1.0}]  # one number each, at each episode's last turn
    rows = torch.tensor([[1.0], [0.0], [0.25], [1.0]])
    assert [a[-1] for a in grpo.turn_advantages(scalar, 4, "group")] == pytest.approx(
        grpo.advantages(rows, torch.ones(1), 4, "group")[0].tolist(), abs=1e-5)


def test_turn_credit_by_state_sets_each_turn_against_the_episodes_that_reached_the_same_context():
    """GiGPO's anchor states, hand-computed: a 'town plus a number' group (lookup, add, answer; each right call pays
    0.25, the right answer 1). All four look the town up alike; at turn 1 one answers wrong at once (e1), one
    tries `add` and slips (e2), two add right (e0 answers right, e3 wrong). Pooled, the slip is charged its extra
    turn (e2's turn 1 below e1's); by state, the two wrong actions taken from one context score alike, and at
    turn 2 e0 and e3 (same context) are set against each other alone, e2 (a context of its own) against nobody."""
    rewards = [{0: 0.25, 1: 0.25, 2: 1.0}, {0: 0.25, 1: 0.0}, {0: 0.25, 1: 0.0, 2: 0.0}, {0: 0.25, 1: 0.25, 2: 0.0}]
    states = [[b"open", b"town", b"added"], [b"open", b"town"], [b"open", b"town", b"slipped"],
              [b"open", b"town", b"added"]]
    # sums 1.5, 0.25, 0.25, 0.5 (mean 0.625): episode terms 0.875, -0.375, -0.375, -0.125, and the same again at
    # turns 0 and 1 (every episode there; returns 1.5/0.25/0.25/0.5, then 1.25/0/0/0.25, mean 0.375); turn 2:
    # e0's 1.0 against e3's 0.0 (mean 0.5): +0.5 and -0.5, e2's alone: 0
    got = grpo.state_advantages(rewards, states, 4, "none")
    expected = [[1.75, 1.75, 1.375], [-0.75, -0.75], [-0.75, -0.75, -0.375], [-0.25, -0.25, -0.625]]
    assert [len(a) for a in got] == [3, 2, 3, 3] and sum(got, []) == pytest.approx(sum(expected, []))
    pooled = grpo.turn_advantages(rewards, 4, "none")
    assert pooled[2][1] < pooled[1][1] and got[2][1] == got[1][1]
    scaled = grpo.state_advantages(rewards, states, 4, "group")
    sums = torch.tensor([1.5, 0.25, 0.25, 0.5], dtype=torch.float64)
    episode = ((sums - sums.mean()) / (sums.std() + 1e-4)).tolist()
    pair = (0.5 / (torch.tensor([1.0, 0.0]).std() + 1e-4)).item()
    assert scaled[0][2] == pytest.approx(episode[0] + pair) and scaled[2][2] == pytest.approx(episode[2])
    assert grpo.state_advantages([{1: 1.0}, {}], [[b"a", b"b"], [b"a", b"c"]], 2, "group") == [[0.0, 0.0], [0.0, 0.0]]


def test_a_step_drawn_with_turn_credit_by_state_carries_each_turns_state_into_its_tokens(tmp_path, tiny,
                                                                                        monkeypatch):
    """Episodes drawn under --turn-credit state: every turn's state is a digest of its context (the opening shared
    by a group, the second turn's told apart by the call made), the episode's one reward is credited per turn
    (GiGPO: the opening's turn carries the episode's advantage twice, a state reached alone once)."""
    import dataclasses

    sampler = _sampler(tmp_path, tiny)
    sampler.on.s = dataclasses.replace(sampler.on.s, turn_credit="state")
    tok = tiny.tokenizer
    calls = [toolcalls.written("look", {"k": "a"}), toolcalls.written("look", {"k": "b"})]
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tok, [calls, ["It is 1.", "no"]]))
    drawn = sampler.draw([0], seed=1)
    (open0, second0), (open1, second1) = drawn.turn_states
    assert open0 == open1 and second0 != second1 and drawn.turn_rewards == [{1: 1.0}, {1: 0.0}]
    a = 0.5 / (torch.tensor([1.0, 0.0]).std().item() + 1e-4)
    groups = StepRows(sampler).groups_of([0], drawn)
    turns = [sorted(set(t)) for t in drawn.turn_of]
    assert turns == [[0, 1], [0, 1]]
    per_turn = [{t: v for t, v in zip(of, adv)} for of, adv in zip(drawn.turn_of, groups.token_advantages)]
    assert per_turn[0] == pytest.approx({0: 2 * a, 1: a}) and per_turn[1] == pytest.approx({0: -2 * a, 1: -a})


@pytest.mark.parametrize("returned, message", [
    ("[1.0, 2.0, 3.0]", "returned 3 per-turn rewards for episode 0, which took 1 turn"),
    ('["high"]', "reward of episode 0, turn 1 is 'high'; return a finite number"),
    ("[float('inf')]", "reward of episode 0, turn 1 is 'inf'"),
    ('"1"', "reward of episode 0 is '1'"),
])
def test_a_per_turn_reward_of_the_wrong_length_or_type_is_refused_naming_the_episode_and_turn(
        tmp_path, tiny, monkeypatch, returned, message):
    from tunebench.core.errors import TunebenchError

    wrong = ENV.replace('''    return float(messages[-1]["role"] == "assistant" and row["a"] in messages[-1]["content"])''',
                        f"    return {returned}")
    sampler = _sampler(tmp_path, tiny, text=wrong)
    monkeypatch.setattr(decoding.Turns, "decode", _scripted(tiny.tokenizer, [["It is 1.", "no"]]))
    with pytest.raises(TunebenchError, match=re.escape(message)):
        sampler.draw([0], seed=1)
