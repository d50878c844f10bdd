"""A GRPO environment's process (core/userprocess.py, as training/grpo/environment.py uses it): its calls' time
limits, a tool stuck in C, what its tools start and how it all ends (a timeout, Ctrl-C, the trainer killed with -9),
the answers it cuts. The episodes these calls make are tests/test_episodes.py's."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_episodes import ENV, _env
from tunebench.core.errors import TunebenchError
from tunebench.training.grpo import environment


def test_a_reset_or_reward_that_never_answers_stops_the_run_in_one_line(tmp_path, monkeypatch):
    """reset and reward run under a time limit of their own (environment.CALLBACK_S): one that never returns is
    the user's bug, refused in one line naming it, where it used to hang the run without a word."""
    stuck = ENV.replace("def reset(row):\n", "def reset(row):\n    if row.get('q') == 'stuck':\n"
                                                "        time.sleep(30)\n")
    stuck = stuck.replace("def reward(messages, row):\n", "def reward(messages, row):\n    if row.get('q') == "
                                                             "'late':\n        time.sleep(30)\n")
    assert stuck.count("time.sleep(30)") == 2
    env = environment.load(str(_env(tmp_path, stuck)), timeout_s=2.0)  # limits a slow machine still answers within
    monkeypatch.setattr(environment, "CALLBACK_S", 2.0)
    assert environment.opening(env, {"q": "k a?"})[0]["content"] == "k a?"
    with pytest.raises(TunebenchError, match=r"reset gave no answer within 2 s on the row \{\"q\": \"stuck\"\}"):
        environment.opening(env, {"q": "stuck"})
    with pytest.raises(TunebenchError, match="reward gave no answer within 2 s; it must return"):
        environment.score(env, [{"role": "assistant", "content": "1"}], {"q": "late", "a": "1"})
    with pytest.raises(TunebenchError, match="reward raised KeyError"):  # as before: its error, in one line
        environment.score(env, [{"role": "assistant", "content": "1"}], {"q": "no answer column"})


def test_a_tool_that_raises_sleeps_past_its_limit_or_gets_bad_arguments_answers_with_an_error(tmp_path):
    path = _env(tmp_path)
    env = environment.load(str(path), timeout_s=2.0)  # the slow call sleeps 5 s; the others answer in milliseconds
    assert environment.call(env, "look", {"k": "a"}) == environment.ToolAnswer("1", True)
    raised = environment.call(env, "look", {"k": "boom"})
    assert not raised.ok and raised.text == "error: ValueError: no such key"
    ran = env.host._state["proc"]
    slow = environment.call(env, "look", {"k": "slow"})
    assert not slow.ok and "no answer within 2 s" in slow.text
    # stopped at its limit, never run on to its end: the process it ran in is gone, and wrote nothing
    assert ran.poll() is not None and not Path(f"{path}.slow-ended").exists()
    assert not environment.call(env, "look", {"k": 3}).ok  # the schema says a string
    assert "no tool named 'find'" in environment.call(env, "find", {}).text
    for extra in ("limit_s", "self"):  # issue 98 N2: names of within()'s own parameters are the tool's to refuse
        named = environment.call(env, "look", {"k": "a", extra: 1})
        assert not named.ok and named.text.startswith("error: TypeError") and f"'{extra}'" in named.text


def test_tools_listed_from_another_module_answer_as_they_would_there(tmp_path):
    """TOOLS may list functions the file imports (benchmarks/agent_env_turns.py lists agent_env.py's): the schema is
    the listed function's, and so is the call. The environment's process looked each tool up by name among the
    file's own attributes, so every call of an imported tool answered AttributeError, and a GRPO run trained on
    nothing but those errors without a word."""
    (tmp_path / "shared_tools.py").write_text(ENV)
    path = tmp_path / "listed.py"
    path.write_text("import sys, pathlib\nsys.path.insert(0, str(pathlib.Path(__file__).parent))\n"
                    "import shared_tools\n\nTOOLS = [shared_tools.look]\nreset, reward = shared_tools.reset, "
                    "shared_tools.reward\n")
    env = environment.load(str(path), timeout_s=10)
    assert [s["function"]["name"] for s in env.schemas] == ["look"]
    assert environment.call(env, "look", {"k": "b"}) == environment.ToolAnswer("2", True)


@pytest.mark.timeout(120, method="thread")  # a revert hangs in C, where the signal method cannot reach
def test_a_tool_stuck_in_a_c_call_is_stopped_at_its_limit_and_the_next_call_answers(tmp_path):
    """A tool in a C call that holds the GIL (a backtracking regular expression) kept a thread of the training process
    from ever giving it back: the run hung past --tool-timeout, Ctrl-C and SIGTERM. The call runs in the environment's
    own process, killed at the limit and started afresh; the next call answers from a new one."""
    stuck = ENV.replace('    if k == "boom":', '    if k == "c":\n        import re\n        re.fullmatch(r"(a|aa)+b", '
                                                '"a" * 90)\n    if k == "boom":')
    env = environment.load(str(_env(tmp_path, stuck)), timeout_s=2.0)
    before = env.host._state["proc"]
    began = time.monotonic()
    answer = environment.call(env, "look", {"k": "c"})
    assert answer == environment.ToolAnswer("error: look gave no answer within 2 s", False)
    assert time.monotonic() - began < 30  # the limit, then a new process started (the old code never returned)
    assert before.poll() is not None and env.host._state["proc"].poll() is None  # killed; a new one is ready
    assert environment.call(env, "look", {"k": "b"}) == environment.ToolAnswer("2", True)


def _alive(pid: int) -> bool:
    """A process that runs: a zombie (ended, not yet reaped: PID 1 in a container may never reap it) is not."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_what_a_tool_starts_ends_with_its_process_and_does_not_inherit_an_ignored_ctrl_c(tmp_path):
    """Issue 98 N3: only the environment's own process was killed at a timeout (a `sleep` a tool started lived on),
    and SIG_IGN for SIGINT passed to every program a tool started."""
    from tunebench.core.userprocess import MODULE, Host

    pids = tmp_path / "pids"
    source = ("import subprocess, time\n"
              "def spawn(wait):\n"
              "    p = subprocess.Popen(['sleep', '300'])\n"
              f"    open({str(pids)!r}, 'a').write(f'{{p.pid}}\\n')\n"
              "    time.sleep(wait)\n"
              "    return 'started'\n").encode()
    host = Host(source, str(tmp_path / "env.py"), "env")
    assert host.ask(("call", MODULE, "spawn", (0,), {}), 30.0) == ("ok", "started")
    first = int(pids.read_text().split()[0])
    ignored = int(re.search(r"SigIgn:\s*([0-9a-f]+)", Path(f"/proc/{first}/status").read_text()).group(1), 16)
    assert not ignored & (1 << (signal.SIGINT - 1))  # Ctrl-C not ignored in what a tool starts
    assert host.ask(("call", MODULE, "spawn", (60,), {}), 3.0) is None  # past its limit: killed and started afresh
    started = [int(pid) for pid in pids.read_text().split()]
    for _ in range(200):
        if not any(_alive(pid) for pid in started):
            break
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in started)  # both sleeps ended with the process that started them


def test_what_a_tool_starts_ends_when_the_training_process_is_killed_with_sigkill(tmp_path):
    """Issue 98 N3, its last case: the trainer killed with -9 took the environment's process with it (its parent-death
    signal) but a `sleep` a tool had started lived on, orphaned, in the environment's group, which no one was left to
    kill. A sentinel the environment's process forks before the user's file runs kills the group once that process
    is gone, however it ended."""
    pids = tmp_path / "pids"
    env = tmp_path / "env.py"
    env.write_text("import subprocess\n"
                   "def spawn():\n"
                   "    p = subprocess.Popen(['sleep', '300'])\n"
                   f"    open({str(pids)!r}, 'a').write(f'{{p.pid}}\\n')\n"
                   "    return 'started'\n")
    trainer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from tunebench.core.userprocess import MODULE, Host\n"
        f"host = Host(open({str(env)!r}, 'rb').read(), {str(env)!r}, 'env')\n"
        "print(host.ask(('call', MODULE, 'spawn', (), {}), 30.0), flush=True)\n"
        "time.sleep(300)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert "started" in trainer.stdout.readline()
        sleep = int(pids.read_text().split()[0])
        assert _alive(sleep)
        trainer.kill()
        trainer.wait()
        for _ in range(200):
            if not _alive(sleep):
                break
            time.sleep(0.05)
        assert not _alive(sleep), "a tool's subprocess outlived the training process killed with -9"
    finally:
        trainer.kill()
        for pid in [int(p) for p in pids.read_text().split()] if pids.exists() else []:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_tools_long_answer_is_cut_in_its_process_and_a_seed_has_a_limit(tmp_path, monkeypatch):
    """Issue 98 N5: an answer was unpickled and tokenized whole, and `seed` waited for ever; N1: the environment's
    process imported Python from the current folder first."""
    from tunebench.core.userprocess import MAX_ANSWER, MODULE, Host

    planted = tmp_path / "cwd" / "tunebench"  # N1: a tunebench/ in the folder the run started from never runs
    planted.mkdir(parents=True)
    (planted / "__init__.py").write_text(f"open({str(tmp_path / 'planted-ran')!r}, 'w').write('ran')\n")
    monkeypatch.chdir(tmp_path / "cwd")
    host = Host(b"import time\ndef long():\n    return 'x' * 100_000\n", str(tmp_path / "env.py"), "env")
    assert not (tmp_path / "planted-ran").exists()
    kind, value = host.ask(("call", MODULE, "long", (), {}), 30.0)
    assert kind == "ok" and value.startswith("x" * MAX_ANSWER) and len(value) < MAX_ANSWER + 100
    assert value.endswith(f"[the answer was cut at {MAX_ANSWER:,} of its 100,000 characters]")
    host.seed(7, 30.0)  # taken
    busy = Host(b"import time\ndef nap():\n    time.sleep(60)\n", str(tmp_path / "nap.py"), "nap")
    busy._state["conn"].send(("call", MODULE, "nap", (), {}))  # the child is inside a call: the seed waits behind it
    with pytest.raises(TunebenchError, match="took no seed within 0.5 s"):
        busy.seed(7, 0.5)


def test_the_environments_process_dies_with_the_training_process_even_by_kill_9(tmp_path):
    """kill -9 of the process that asks leaves nothing behind, even while its environment's process is inside a call
    that never returns (it would never read its closed pipe: Linux's parent-death signal ends it)."""
    script = ("import sys, time\nfrom tunebench.core.userprocess import Host\n"
              "h = Host(b'def spin():\\n    while True:\\n        pass\\n', sys.argv[1], 'env')\n"
              "h._state['conn'].send(('call', 0, 'spin', (), {}))\n"  # in the pipe before the pid is printed
              "print(h._state['proc'].pid, flush=True)\ntime.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "env.py")], stdout=subprocess.PIPE,
                              text=True)
    child = int(parent.stdout.readline())
    os.kill(child, 0)  # alive
    parent.kill()
    parent.wait()
    for _ in range(500):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    else:
        os.kill(child, signal.SIGKILL)  # not left spinning beside the rest of the suite
        pytest.fail(f"the environment's process {child} outlived its parent")
