"""`tunebench serve`'s OpenAI-compatible API, read with the real `openai` client: the models served, chat and
plain completions, streamed and not, the sampling settings, stop sequences, usage counts, the API key, the
limits, and several adapters on one base picked per request by name."""

import json
import socket

import pytest

from conftest import needs_module, tiny_run_config
from tunebench.interfaces.web import models

needs_module("gradio", "serve needs gradio (pip install -e '.[web]')")
openai = needs_module("openai", "the API is checked with the openai client (in the test extra)")

from tunebench.interfaces.web import app  # noqa: E402


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The tiny base and two LoRA runs of it, served with a login; (client, the two run paths, the registry
    of a server that serves each alone is built per test)."""
    from tunebench.jobs import finetune

    root = tmp_path_factory.mktemp("api")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"question {i}", "response": f"answer {i}"}) + "\n"
                            for i in range(12)))
    runs = []
    for name, seed, lr in (("a", 1, 1e-2), ("b", 7, 5e-2)):
        finetune.run(tiny_run_config(data, root / name, **{"train.max_steps": 3, "train.seed": seed,
                                                           "train.lr": lr}))
        runs.append(str(root / name))
    port = _port()
    server = app.serve(["tiny"], runs, port=port, ab_db=str(root / "ab.sqlite"), block=False, auth="ann:s3cret",
                       api_key="sk-api-key")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-api-key", max_retries=0, timeout=120)
    yield client, runs, port
    server.close()


def _alone(spec, messages, max_new_tokens, raw=False, **kw):
    """What the model answers when it is the only one served, through the app's own stream."""
    registry = models.Registry(models.entries([spec] if spec == "tiny" else [], [] if spec == "tiny" else [spec]))
    *_, done = models.stream(registry, registry.labels[0], messages, max_new_tokens, raw=raw, **kw)
    return done


def test_the_models_are_listed_by_name_and_the_key_is_its_own_not_the_login_password(served):
    client, runs, port = served
    assert [m.id for m in client.models.list()] == ["tiny", *runs]
    for key in ("nope", "s3cret"):  # a wrong key, and the page's password, which is no API key
        wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="needs its API key"):
            wrong.models.list()
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_chat_answers_as_the_app_does_with_usage_streamed_or_not(served):
    client, runs, _ = served
    messages = [{"role": "user", "content": "question 3"}]
    for model in ("tiny", *runs):
        done = _alone(model, messages, 12, temperature=0.0, top_p=1.0)
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        assert reply.object == "chat.completion" and reply.model == model
        assert reply.choices[0].message.content == done.text, model  # each adapter as if served alone
        assert reply.usage.prompt_tokens == done.prompt_tokens and reply.usage.completion_tokens == done.new_tokens
        assert reply.usage.total_tokens == done.prompt_tokens + done.new_tokens
        assert reply.choices[0].finish_reason == ("stop" if done.ended else "length")
        chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == done.text and chunks[0].choices[0].delta.role == "assistant"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == done.new_tokens
    assert {client.chat.completions.create(model=m, messages=messages, max_tokens=12, temperature=0)
            .choices[0].message.content for m in runs} == {_alone(m, messages, 12, temperature=0.0).text for m in runs}


def test_completions_take_the_prompt_as_it_is_and_honour_stop_seed_and_sampling(served):
    client, runs, _ = served
    done = _alone(runs[0], [{"role": "user", "content": "question 5"}], 16, raw=True, temperature=0.0)
    reply = client.completions.create(model=runs[0], prompt="question 5", max_tokens=16, temperature=0)
    assert reply.choices[0].text == done.text and reply.usage.prompt_tokens == done.prompt_tokens
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=runs[0], prompt="question 5", max_tokens=16, temperature=0, stream=True))
    assert streamed == done.text
    assert len(done.text) > 4, f"the greedy answer {done.text!r} is too short to check a stop sequence on"
    stop = done.text[2:4]  # a stop sequence ends the answer before it, and says so
    cut = client.completions.create(model=runs[0], prompt="question 5", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == done.text[:done.text.find(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=12, temperature=1.0, top_p=0.9, seed=s)
               .choices[0].message.content for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]  # one seed, one answer
    for seed, answer in ((1, sampled[0]), (2, sampled[2])):  # each the seed's own, as the app draws it
        assert answer == _alone("tiny", [{"role": "user", "content": "hi"}], 12, temperature=1.0, top_p=0.9,
                                seed=seed).text


def test_bad_requests_get_openais_errors_before_anything_runs(served):
    client, runs, _ = served
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4o' is not served here"):
        client.chat.completions.create(model="gpt-4o", messages=hi)
    for kwargs, message in (({"max_tokens": 100_000}, "'max_tokens' must be a whole number from 1 to 512"),
                            ({"temperature": 3}, "'temperature' must be a number from 0 to 2"),
                            ({"n": 2}, "'n' must be 1"),
                            ({"stop": ["a", "b", "c", "d", "e"]}, "'stop' must be a string or a list of up to 4"),
                            ({"logprobs": True}, "'logprobs' is not supported by tunebench serve"),
                            ({"presence_penalty": 0.5}, "'presence_penalty' is not supported"),
                            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
                             "'tools' is not supported")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model="tiny", messages=hi, **kwargs)
    with pytest.raises(openai.BadRequestError, match="the message is 9,000 characters; the limit is 8,000"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 9000}])
    with pytest.raises(openai.BadRequestError, match="'messages' must be a non-empty list"):
        client.chat.completions.create(model="tiny", messages=[])


def test_a_client_over_its_share_is_told_to_wait(tmp_path, monkeypatch):
    """The API has its own per-client share: with a share of 0, a request is a 429 the client can act on."""
    monkeypatch.setattr(app, "API_PER_CLIENT", 0)
    port = _port()
    server = app.serve(["tiny"], [], port=port, ab_db=str(tmp_path / "ab.sqlite"), block=False)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError, match="busy: you already have 0 answers being generated"):
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, stream=stream)
    finally:
        server.close()
