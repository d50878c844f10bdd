"""`tunebench serve` and `tunebench ab-report`: the A/B store, the app's handlers, the app over HTTP,
and a real browser voting in the A/B tab."""

import json
import multiprocessing
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import free_port, needs_module, tiny_run_config
from tunebench.core.errors import TunebenchError
from tunebench.data import votes

gr = needs_module("gradio", "the web app needs gradio (pip install -e '.[web]')")

from tunebench.interfaces.web import app, chat_ab, models  # noqa: E402


def _vote(db, a, b, vote):
    votes.record(db, "p", a, b, "answer a", "answer b", vote, {"temperature": 0.7})


def test_the_store_reports_each_pair_whichever_side_its_models_were_shown_on(tmp_path):
    db = votes.open_store(tmp_path / "ab.sqlite")
    for a, b, vote in [("base", "tuned", "b"), ("tuned", "base", "a"), ("base", "tuned", "tie"),
                       ("tuned", "base", "both_bad"), ("base", "tuned", "a"), ("x", "tuned", "a")]:
        _vote(db, a, b, vote)
    pairs = {(p.first, p.second): p for p in votes.pairs(db)}
    tuned = pairs[("base", "tuned")]
    assert (tuned.first_wins, tuned.second_wins, tuned.ties, tuned.both_bad, tuned.votes) == (1, 2, 1, 1, 5)
    assert tuned.win_rate == pytest.approx(1.5 / 4)  # base: one win and a half of the tie, of 4 judged votes
    assert pairs[("tuned", "x")].second_wins == 1
    text = votes.report(db)
    assert "6 vote(s)" in text and "37.5%" in text
    with pytest.raises(ValueError, match="vote must be one of"):
        _vote(db, "a", "b", "maybe")
    row = json.loads(votes.connect(db).execute("SELECT settings FROM votes LIMIT 1").fetchone()[0])
    assert row == {"temperature": 0.7}


def test_the_wilson_interval_on_a_known_case():
    low, high = votes.wilson(8, 10)  # the textbook case: 8 of 10, 95%
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)
    assert votes.wilson(0, 0) == (0.0, 1.0)
    low, high = votes.wilson(0, 5)
    assert low == 0.0 and 0.43 < high < 0.44


def _writer(db, n, name):
    for _i in range(n):
        _vote(db, name, "other", random.choice(votes.VOTES))


def test_concurrent_writers_lose_no_vote(tmp_path):
    db = votes.open_store(tmp_path / "ab.sqlite")
    threads = [threading.Thread(target=_writer, args=(db, 25, f"t{k}")) for k in range(4)]
    procs = [multiprocessing.get_context("spawn").Process(target=_writer, args=(db, 25, f"p{k}")) for k in range(2)]
    for w in threads + procs:
        w.start()
    for w in threads + procs:
        w.join()
    assert all(p.exitcode == 0 for p in procs)
    assert sum(p.votes for p in votes.pairs(db)) == 150


def test_bad_input_is_one_line_before_any_model_loads(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TunebenchError, match="holds no model"):
        app.serve(app.Served(["tiny"], [str(tmp_path / "empty")]), app.Door(port=0), ab_db=str(tmp_path / "ab.sqlite"), block=False)
    with pytest.raises(TunebenchError, match="prompt file .* cannot be read"):
        app.serve(app.Served(["tiny"], []), app.Door(port=0), ab_db=str(tmp_path / "ab.sqlite"), prompts=str(tmp_path / "none.jsonl"), block=False)
    (tmp_path / "notdb.sqlite").write_text("not a database, just text that is long enough" * 40)
    with pytest.raises(TunebenchError, match="not a usable A/B database"):
        app.serve(app.Served(["tiny"], []), app.Door(port=0), ab_db=str(tmp_path / "notdb.sqlite"), block=False)
    with socket_in_use() as port, pytest.raises(TunebenchError, match=f"port {port} .* in use"):
        app.serve(app.Served(["tiny"], []), app.Door(port=port), ab_db=str(tmp_path / "ab.sqlite"), block=False)


class socket_in_use:
    def __enter__(self):
        import socket

        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        self.s.listen(1)
        return self.s.getsockname()[1]

    def __exit__(self, *exc):
        self.s.close()


def test_prompt_sets_read_jsonl_and_csv(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"instruction": "one"}\n{"prompt": "two", "x": 1}\n{"other": "three"}\n')
    (tmp_path / "p.csv").write_text("flags,instruction,response\nB,how do I cancel?,like so\n")
    assert models.load_prompts(tmp_path / "p.jsonl") == ["one", "two", "three"]
    assert models.load_prompts(tmp_path / "p.csv") == ["how do I cancel?"]
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(TunebenchError, match="does not parse"):
        models.load_prompts(tmp_path / "bad.jsonl")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A tiny LoRA run to serve beside its base."""
    from tunebench.jobs import finetune

    root = tmp_path_factory.mktemp("serve")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"question {i}", "response": f"answer {i}"}) + "\n"
                            for i in range(12)))
    out = root / "tuned"
    finetune.run(tiny_run_config(data, out, **{"train.max_steps": 2}))
    return str(out)


def test_the_handlers_chat_and_vote_blind(tmp_path, tuned):
    registry = models.Registry(models.entries(["tiny"], [tuned]))
    assert registry.get(registry.labels[0]) is registry.get(registry.labels[0])  # loaded once
    history, status = list(chat_ab.chat_turn(registry, registry.labels[1], "hello", [], 0.7, 0.9, 8))[-1]
    assert history[0] == {"role": "user", "content": "hello"} and history[1]["role"] == "assistant"
    assert "tokens/s" in status
    db = votes.open_store(tmp_path / "ab.sqlite")
    shown = set()
    for seed in range(8):  # the order is random: both orders show up
        *_, (answer_a, answer_b, status, state) = chat_ab.ab_answers(registry, registry.labels[0], registry.labels[1],
                                                                  "hi there", 0.7, 0.9, 8, random.Random(seed))
        shown.add(state["model_a"])
        assert state["answer_a"] == answer_a and "Which answer is better?" in status
    assert shown == set(registry.labels)
    assert "tokens/s" not in status  # blind: a speed would name the model before the vote
    # Nothing of either answer shows before both are done (A streaming first showed each side's speed), and
    # greedy sampling, whose answers the Chat tab would name, is refused.
    steps = list(chat_ab.ab_answers(registry, registry.labels[0], registry.labels[1], "hi there", 0.7, 0.9, 8))
    assert all(a == b == "" for a, b, _, _ in steps[:-1]) and steps[-1][3]["answer_a"] == steps[-1][0]
    with pytest.raises(TunebenchError, match="temperature of 0.3 or more"):
        list(chat_ab.ab_answers(registry, registry.labels[0], registry.labels[1], "hi there", 0.0, 0.9, 8))
    # While the pair is open, the Chat tab hides the speed of both its models (it would name a side);
    # the vote reveals them and the Chat tab shows speeds again.
    blinded = chat_ab.Blinded()
    *_, (_, _, _, state) = chat_ab.ab_answers(registry, registry.labels[0], registry.labels[1], "hi there", 0.7, 0.9, 8,
                                          blinded=blinded)
    for label in registry.labels:
        _, status = list(chat_ab.chat_turn(registry, label, "hello", [], 0.7, 0.9, 8, blinded))[-1]
        assert "tokens/s" not in status and "speed hidden" in status
    message, state = chat_ab.ab_vote(db, "b", state, blinded)
    assert f"A was {state['model_a']}" in message and state["voted"] and "tokens/s" in message  # revealed
    _, status = list(chat_ab.chat_turn(registry, registry.labels[0], "hello", [], 0.7, 0.9, 8, blinded))[-1]
    assert "tokens/s" in status
    with pytest.raises(TunebenchError, match="already voted on"):
        chat_ab.ab_vote(db, "a", state)  # one vote per pair of answers
    (pair,) = votes.pairs(db)
    winner = state["model_b"]
    assert (pair.first_wins if winner == pair.first else pair.second_wins) == 1




def test_the_app_starts_on_a_free_port_and_answers(tmp_path, tuned):
    port = free_port()
    served = app.serve(app.Served(["tiny"], [tuned]), app.Door(port=port), ab_db=str(tmp_path / "ab.sqlite"), block=False)
    try:
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30).read().decode()
        config = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/config", timeout=30).read())
        assert config["title"] == "tunebench" and '"title":"tunebench"' in page.replace(" ", "")  # the page's own
        labels = {c.get("props", {}).get("label") for c in config["components"]}
        assert {"Model 1", "Model 2", "Prompt", "A", "B"} <= labels
        (chatbot,) = [c["props"] for c in config["components"] if c.get("props", {}).get("label") == "Conversation"]
        assert chatbot["render_markdown"] is False  # a reply's ![](http://...) is text, not a fetch
        assert served.show_error is False and served.max_file_size == 2**20  # launch's hardening
        assert served._queue.max_size == app.QUEUE_SIZE
        # Gradio's run-history routes (no login check of their own) are off
        for route in ("/gradio_api/run-history/records", "/gradio_api/runs"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{port}{route}", timeout=30)
            assert e.value.code == 404, route
    finally:
        served.close()


def _chat_refused(tmp_path, tuned, message: str, match: str) -> None:
    """A real server's Chat handler, called through gradio_client with `message`, refuses it with `match`."""
    from gradio_client import Client

    port = free_port()
    served = app.serve(app.Served(["tiny"], [tuned]), app.Door(port=port), ab_db=str(tmp_path / "ab.sqlite"),
                       block=False)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        with pytest.raises(Exception, match=match):
            client.predict("base: tiny", message, 0.7, 0.9, 8, api_name="/on_chat")
    finally:
        served.close()


def test_a_client_over_its_share_of_the_workers_is_told_busy(tmp_path, tuned, monkeypatch):
    """The per-client limit is on the app's handlers: with a share of 0, every request is answered busy."""
    monkeypatch.setattr(app, "PER_CLIENT", 0)
    _chat_refused(tmp_path, tuned, "hello", "busy: you already have 0 answers being generated")


def test_a_handlers_problem_reaches_the_visitor_as_its_one_line(tmp_path, tuned):
    """chat_ab raises TunebenchError without Gradio; the app shows its line to the visitor (Gradio's error), as a
    page or a gradio_client sees it."""
    _chat_refused(tmp_path, tuned, "   ", "Type a message first")


def _browser(chromium):
    needs_module("selenium", "the browser test drives Chromium through selenium (in the test extra)")
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1100",
                 "--disable-dev-shm-usage"):
        opts.add_argument(flag)
    opts.binary_location = chromium[0]
    return webdriver.Chrome(options=opts, service=webdriver.ChromeService(chromium[1]))


def test_a_browser_votes_in_the_ab_tab_and_the_vote_is_stored(tmp_path, tuned, chromium):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser = _browser(chromium)
    port = free_port()
    db = tmp_path / "ab.sqlite"
    served = app.serve(app.Served(["tiny"], [tuned]), app.Door(port=port, auth="ann:s3cret"), ab_db=str(db), block=False)
    wait = WebDriverWait(browser, 60)

    def tab(name):
        wait.until(lambda d: any(b.text.strip() == name for b in d.find_elements(By.CSS_SELECTOR, "button[role=tab]")))
        next(b for b in browser.find_elements(By.CSS_SELECTOR, "button[role=tab]") if b.text.strip() == name).click()
        time.sleep(1)
        browser.save_screenshot(str(tmp_path / f"{name.replace('/', '')}.png"))

    def button(text):
        return wait.until(ec.element_to_be_clickable(
            (By.XPATH, f"//button[normalize-space()='{text}' and not(@role='tab')]")))

    try:
        browser.get(f"http://127.0.0.1:{port}/")
        password = wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, "input[type=password]")))
        browser.save_screenshot(str(tmp_path / "login.png"))
        assert "Vote" not in browser.page_source  # nothing of the app before the login
        for secret in ("wrong", "s3cret"):
            browser.get(f"http://127.0.0.1:{port}/")
            password = wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, "input[type=password]")))
            browser.find_elements(By.CSS_SELECTOR, "input[type=text], input:not([type])")[0].send_keys("ann")
            password.send_keys(secret)
            button("Login").click()
            if secret == "wrong":
                wait.until(lambda d: "incorrect" in d.page_source.lower())
        def body():
            return browser.find_element(By.TAG_NAME, "body").text

        tab("Chat")  # a chat turn: the question and an answer with its speed
        chat = wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, "textarea[placeholder^='Ask something']")))
        chat.send_keys("Hello there" + Keys.ENTER)
        wait.until(lambda d: "tokens/s" in body())
        assert "Hello there" in body()
        tab("A/B")  # a prompt set uploaded, its first prompt taken
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"prompt": "How do I cancel my order?"}\n{"prompt": "Where is my refund?"}\n')
        browser.find_element(By.XPATH, "//*[normalize-space(text())='Prompt set: step through a fixed list of "
                                       "prompts']").click()
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "input[type=file]"))).send_keys(str(prompts))
        wait.until(lambda d: "2 prompts loaded" in body())
        button("Next prompt from the set").click()
        box = browser.find_element(By.CSS_SELECTOR, "textarea[placeholder^='Type a prompt']")
        wait.until(lambda d: box.get_attribute("value") == "How do I cancel my order?")
        button("Get answers").click()
        wait.until(lambda d: "Which answer is better?" in d.page_source)
        assert "tokens/s" not in body()  # blind until the vote
        tab("Chat")  # the chat's model is in the open pair: its speed is not shown now
        chat.send_keys("Again" + Keys.ENTER)
        wait.until(lambda d: "speed hidden while a blind A/B comparison" in body())
        tab("A/B")
        from selenium.webdriver import ActionChains

        ActionChains(browser).double_click(button("A is better")).perform()  # two fast clicks, one vote
        wait.until(lambda d: "Vote #1 stored" in d.page_source)
        wait.until(lambda d: not served._queue.event_ids_to_events)  # every event the clicks sent has been answered
        browser.save_screenshot(str(tmp_path / "voted.png"))
        tab("A/B results")  # the stored vote's row: its win rate and its Wilson interval, as the store computes them
        (row,) = votes.table(db)[1]
        wait.until(lambda d: f"{row[7]}" in body() and row[8] in body())
    finally:
        browser.quit()
        served.close()
    (pair,) = votes.pairs(db)
    assert pair.votes == 1 and pair.first_wins + pair.second_wins == 1
    prompt, = votes.connect(db).execute("SELECT prompt FROM votes").fetchone()
    assert prompt == "How do I cancel my order?"
    for shot in ("login", "Chat", "AB", "voted", "AB results"):
        assert (tmp_path / f"{shot}.png").stat().st_size > 10_000


def test_the_cli_reports_votes_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    from tunebench.interfaces.cli import main

    db = votes.open_store(tmp_path / "ab.sqlite")
    _vote(db, "base", "tuned", "b")
    assert main(["ab-report", str(db)]) == 0
    out = capsys.readouterr().out
    assert "1 vote(s)" in out and "base" in out and "0.0%" in out
    assert main(["ab-report", str(tmp_path / "none.sqlite")]) != 0
    (tmp_path / "empty").mkdir()
    assert main(["serve", "--adapter", str(tmp_path / "empty"), "--ab-db", str(tmp_path / "x.sqlite")]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "holds no model" in err and "Traceback" not in err


def test_a_pair_takes_one_vote_however_fast_the_clicks(tmp_path, tuned):
    registry = models.Registry(models.entries(["tiny"], [tuned]))
    db = votes.open_store(tmp_path / "ab.sqlite")
    *_, (_, _, _, state) = chat_ab.ab_answers(registry, registry.labels[0], registry.labels[1], "hi", 0.7, 0.9, 4)
    results = []
    barrier = threading.Barrier(4)

    def click(vote):
        barrier.wait()  # the same state, as two clicks before the first reply would give
        try:
            results.append(chat_ab.ab_vote(db, vote, dict(state))[0])
        except TunebenchError:
            results.append("refused")

    threads = [threading.Thread(target=click, args=(v,)) for v in ("a", "b", "a", "tie")]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert sorted(r == "refused" for r in results) == [False, True, True, True]
    assert votes.pairs(db)[0].votes == 1


def test_requests_past_the_limits_or_the_context_are_refused(tuned):
    registry = models.Registry(models.entries(["tiny"], []))
    label = registry.labels[0]
    with pytest.raises(models.TooLong, match="the limit is 8,000"):
        list(models.stream(registry, label, [{"role": "user", "content": "x" * 9000}]))
    long_chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": "y" * 7000} for i in range(5)]
    with pytest.raises(models.TooLong, match="over the 32,000 a chat may reach"):
        list(models.stream(registry, label, long_chat))
    with pytest.raises(models.TooLong, match="this model sees 512"):  # tiny: 512 rotary positions
        list(models.stream(registry, label, [{"role": "user", "content": "z" * 600}]))
    gpt2 = models.Registry(models.entries(["gpt2-124m"], []))  # learned positions: past 1024 there is no row
    with pytest.raises(models.TooLong, match="this model sees 1,024"):
        list(models.stream(gpt2, gpt2.labels[0], [{"role": "user", "content": "word " * 1500}]))
    with pytest.raises(TunebenchError, match="the limit is"):  # the handler says it to the visitor in one line
        list(chat_ab.chat_turn(registry, label, "x" * 9000, [], 0.7, 0.9, 8))


def test_a_closed_stream_stops_its_generation_and_frees_the_lock():
    registry = models.Registry(models.entries(["tiny"], []))
    label = registry.labels[0]
    before = threading.active_count()
    replies = models.stream(registry, label, [{"role": "user", "content": "hello"}], max_new_tokens=512,
                            temperature=0.0)
    next(replies)  # generating now
    t0 = time.perf_counter()
    replies.close()  # the browser went away
    assert registry.generate_lock.acquire(blocking=False), "the lock was kept by a finished request"
    registry.generate_lock.release()
    assert threading.active_count() == before and time.perf_counter() - t0 < 30  # no generation left running
    *_, done = models.stream(registry, label, [{"role": "user", "content": "hello"}], max_new_tokens=4)
    assert done.done and done.new_tokens <= 4  # and the server serves on


def test_an_exposed_server_needs_a_login_unless_refused_on_purpose(tmp_path, capsys):
    from tunebench.interfaces.cli import main

    with pytest.raises(TunebenchError, match="--host 0.0.0.0 lets other machines in, and no --auth is set"):
        app.check_exposure("0.0.0.0", None, False)
    app.check_exposure("0.0.0.0", ("u", "p"), False)
    app.check_exposure("0.0.0.0", None, True)
    app.check_exposure("127.0.0.1", None, False)
    assert app.parse_auth("ann:se:cret") == ("ann", "se:cret")
    for bad in ("nopassword", ":x", "x:"):
        with pytest.raises(TunebenchError, match="USER:PASSWORD"):
            app.parse_auth(bad)
    assert main(["serve", "--host", "0.0.0.0", "--model", "tiny", "--ab-db", str(tmp_path / "x.sqlite")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--no-auth" in err and not (tmp_path / "x.sqlite").exists()


def test_an_upload_is_read_once_and_removed(tmp_path):
    upload = tmp_path / "prompts.jsonl"
    upload.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    assert chat_ab.read_upload(str(upload)) == ["one", "two"] and not upload.exists()
    bad = tmp_path / "bad.csv"
    bad.write_text("")
    with pytest.raises(TunebenchError, match="holds no prompts"):
        chat_ab.read_upload(str(bad))
    assert not bad.exists()
    big = tmp_path / "big.jsonl"  # the studio's page takes 200 MB uploads; a prompt set stays at 1 MB
    big.write_text('{"prompt": "one"}\n' * (chat_ab.PROMPT_SET_BYTES // 18 + 1))
    with pytest.raises(TunebenchError, match="the limit is 1,048,576"):
        chat_ab.read_upload(str(big))
    assert not big.exists()


def test_serving_places_the_model_as_training_would(monkeypatch):
    from tunebench.machine import hardware
    from tunebench.model import inference
    gpu = hardware.Hardware("cpu", 8, 16, frozenset(), 8000, 8000, "Linux",
                            gpus=(hardware.GPU(0, "NVIDIA H100 80GB HBM3", 81_000, (9, 0)),))
    assert inference.placement("auto", "auto", gpu)[:2] == ("cuda", "bf16")
    assert inference.placement("cpu", "fp32", gpu)[:2] == ("cpu", "fp32")
    placed = []
    monkeypatch.setattr(inference, "place", lambda loaded, device, precision: placed.append((device, precision))
                        or loaded)
    registry = models.Registry(models.entries(["tiny"], []), device="cpu", precision="fp32")
    registry.get(registry.labels[0])
    assert placed == [("cpu", "fp32")]


def test_runs_of_one_base_share_it_and_answer_as_if_loaded_alone(tuned, tmp_path, monkeypatch):
    """Two LoRA runs of one base are two named adapters on one loaded model; each answers as it does
    when it is the only one served."""
    from tunebench.jobs import finetune

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"ask {i}", "response": f"reply {i}"}) + "\n" for i in range(12)))
    other = tmp_path / "other"
    finetune.run(tiny_run_config(data, other, **{"train.max_steps": 3, "train.seed": 7, "train.lr": 0.05}))
    both = models.Registry(models.entries(["tiny"], [tuned, str(other)]))

    def reply(registry, label):
        *_, done = models.stream(registry, label, [{"role": "user", "content": "question 3"}], max_new_tokens=12,
                                 temperature=0)
        return done.text

    answers = {label: reply(both, label) for label in both.labels[1:] * 2}  # switching back and forth
    assert both.bases_loaded() == 1  # one base, shared by both runs
    for run, label in zip([tuned, str(other)], both.labels[1:]):
        alone = models.Registry(models.entries([], [run]))
        assert reply(alone, alone.labels[0]) == answers[label]
    assert answers[both.labels[1]] != answers[both.labels[2]]

    # at most MAX_LOADED models stay in memory: with 1, each pick evicts the last, and answers stay the same
    monkeypatch.setattr(models, "MAX_LOADED", 1)
    one = models.Registry(models.entries(["tiny"], [tuned, str(other)]))
    for label in [*one.labels, *one.labels]:
        assert reply(one, label) == (answers[label] if label in answers else reply(both, label))
        assert one.bases_loaded() == 1


def test_the_model_cap_holds_while_another_generation_runs(tuned, tmp_path, monkeypatch):
    """At most MAX_LOADED models stay loaded, and the one a generation decodes on: a load made while another
    request generates evicts the least recently used of the others. (Eviction used to wait for no generation to
    run, so under steady traffic every model asked for stayed in memory.)"""
    from tunebench.jobs import finetune

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"ask {i}", "response": f"reply {i}"}) + "\n" for i in range(12)))
    full = tmp_path / "full"
    finetune.run(tiny_run_config(data, full, **{"train.max_steps": 1, "adapter.method": "full"}))
    monkeypatch.setattr(models, "MAX_LOADED", 1)
    registry = models.Registry(models.entries(["tiny"], [tuned, str(full)]))
    base, adapter, model = registry.labels  # three models of their own
    with registry.generate_lock:  # a generation decodes on the base
        registry.get(base, generating=True)
        registry.get(adapter)  # the cap, and the model in use beside it
        registry.get(model)  # the adapter's model goes, not the one in use
        assert registry.bases_loaded() == 2 and set(registry._loaded) == {base, model}
        registry.done_generating()
    registry.get(adapter)
    assert registry.bases_loaded() == 1 and set(registry._loaded) == {adapter}


def test_an_ipv6_loopback_host_is_checked_as_ipv6():
    """`serve --host ::1` was refused as "port in use": the port was tried with an IPv4 socket."""
    import socket

    from tunebench.interfaces.web.app import check_port

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    check_port("::1", port)  # free again once closed
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", port))
        s.listen()
        with pytest.raises(TunebenchError, match=f"port {port} on ::1 is in use"):
            check_port("::1", port)


def test_a_pair_left_without_a_vote_stops_hiding_speeds_after_its_time():
    blinded = chat_ab.Blinded(hours=1)
    blinded.open("p1", ("base", "run"))
    assert blinded.hides("run") and blinded.hides("base") and not blinded.hides("other")
    blinded.close("p1")
    assert not blinded.hides("run")
    blinded.open("p2", ("base", "run"))
    blinded.seconds = 0  # an hour later
    time.sleep(0.01)
    assert not blinded.hides("run")


def test_one_client_gets_its_share_of_the_workers_and_then_busy():
    limit = app.ClientLimit(2)
    with limit.hold("host:10.0.0.1"), limit.hold("host:10.0.0.1"):
        with pytest.raises(app.Busy, match="busy: you already have 2 answers being generated"):
            with limit.hold("host:10.0.0.1"):
                pass
        with limit.hold("host:10.0.0.2"):  # another client is not held back
            pass
    with limit.hold("host:10.0.0.1"):  # released when the answers end
        pass
    assert not limit._running

    class Request:  # what Gradio passes: the login if any, else the address
        username = None
        client = type("Client", (), {"host": "10.0.0.1"})()
    assert app.client_of(Request()) == "host:10.0.0.1"
    Request.username = "ann"
    assert app.client_of(Request()) == "user:ann"


def test_children_the_server_starts_get_none_of_its_secrets(tmp_path, monkeypatch):
    """llama.cpp's converter (serve --runtime llama.cpp converts a run to GGUF) and a training child: the page's
    login and the API key stay in the server."""
    import subprocess

    from tunebench.jobs import children
    from tunebench.model import llama_cpp_tools

    monkeypatch.setenv("TUNEBENCH_API_KEY", "sk-server-only")
    monkeypatch.setenv("TUNEBENCH_AUTH", "admin:server-only")
    seen = []

    def fake_run(argv, **kw):
        seen.append(kw["env"])
        return subprocess.CompletedProcess(argv, 1, "", "no")

    monkeypatch.setattr(llama_cpp_tools, "converter", lambda: tmp_path)
    monkeypatch.setattr(llama_cpp_tools.subprocess, "run", fake_run)
    with pytest.raises(TunebenchError):
        llama_cpp_tools.convert(tmp_path, tmp_path / "out.gguf", "f16")
    proc = children.start("train", tiny_run_config(tmp_path / "d.jsonl", tmp_path / "run"), tmp_path / "run",
                          log=tmp_path / "log.txt", program=[sys.executable, "-c", "import os, sys; print(sorted("
                                                             "k for k in os.environ if k.startswith('TUNEBENCH')))"])
    assert proc.wait(60) == 0
    assert [e.get("TUNEBENCH_API_KEY") for e in seen] == [None] and "PYTHONPATH" in seen[0]
    assert "TUNEBENCH_API_KEY" not in (tmp_path / "log.txt").read_text()


def test_a_served_export_is_made_again_once_the_run_is_trained_again(tmp_path, monkeypatch):
    """serve --runtime llama.cpp reuses RUN/export/NAME-f16.gguf only while it is the run's: after `train
    --overwrite` replaced the weights, the stale file is exported again in its place (not served as the run)."""
    from tunebench.jobs import export

    run = tmp_path / "r"
    (run / "export").mkdir(parents=True)
    (run / "adapter_model.safetensors").write_bytes(b"first weights")
    made = []

    def fake_export(run_dir, fmt, quant, output, allow_download):
        target = Path(output) if output else Path(run_dir) / "export" / "r-f16.gguf"
        target.write_bytes((Path(run_dir) / "adapter_model.safetensors").read_bytes())
        made.append(target.name)
        return target

    monkeypatch.setattr(export, "export", fake_export)
    f16 = app.f16_export(str(run))
    assert app.f16_export(str(run)) == f16 and made == ["r-f16.gguf"]  # once, then reused
    (run / "adapter_model.safetensors").write_bytes(b"second weights")  # retrained (train --overwrite)
    assert app.f16_export(str(run)) == f16 and f16.read_bytes() == b"second weights"
    assert made == ["r-f16.gguf", "r-f16.new.gguf"] and not (run / "export" / "r-f16.new.gguf").exists()
    (run / "export" / ".r-f16.gguf.source.json").unlink()  # a file exported by hand after training: the run's
    assert app.f16_export(str(run)) == f16 and len(made) == 2
