"""`tunebench serve`'s OpenAI-compatible API, read with the real `openai` client: the models served, chat and
plain completions, streamed and not, the sampling settings, stop sequences, usage counts, the API key, the
limits, and several adapters on one base picked per request by name."""

import json

import pytest

from conftest import WEATHER, free_port, needs_module, tiny_run_config, weather_calls_file
from tunebench.interfaces.web import models

needs_module("gradio", "serve needs gradio (pip install -e '.[web]')")
openai = needs_module("openai", "the API is checked with the openai client (in the test extra)")

from tunebench.interfaces.web import app  # noqa: E402


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
    port = free_port()
    server = app.serve(app.Served(["tiny"], runs), app.Door(port=port, auth="ann:s3cret", api_key="sk-api-key"), ab_db=str(root / "ab.sqlite"), block=False)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-api-key", max_retries=0, timeout=120)
    yield client, runs, port
    server.close()


def _alone(spec, messages, max_new_tokens, raw=False, **kw):
    """What the model answers when it is the only one served, through the app's own stream."""
    registry = models.Registry(models.entries([spec] if spec == "tiny" else [], [] if spec == "tiny" else [spec]))
    *_, done = models.stream(registry, registry.labels[0], messages, max_new_tokens, raw=raw, **kw)
    return done


def test_uploads_go_to_a_folder_of_the_servers_own(served):
    """Gradio's default upload folder, /tmp/gradio, is shared by every user of the machine: serve gives it one
    only this user can read, and the page's cache is there."""
    import os
    import stat

    from gradio.utils import get_upload_folder

    folder = get_upload_folder()
    assert folder != "/tmp/gradio" and folder == os.environ["GRADIO_TEMP_DIR"]
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700


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
                            ({"functions": [{"name": "f", "parameters": {}}]}, "'functions' is not supported"),
                            ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
                                "type": "function", "function": {"name": "g"}}}, "names 'g', which is not one of"),
                            ({"tool_choice": "required"}, "offers no 'tools'"),
                            ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
                             "'tools': .*not a function schema with a name")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model="tiny", messages=hi, **kwargs)
    with pytest.raises(openai.BadRequestError, match="the message is 9,000 characters; the limit is 8,000"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 9000}])
    with pytest.raises(openai.BadRequestError, match="'messages' must be a non-empty list"):
        client.chat.completions.create(model="tiny", messages=[])
    deep = [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[" * 50_000 + "]" * 50_000}}]}, *hi]
    many = [{"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
        "name": "f", "arguments": "{}"}} for i in range(257)]}, *hi]  # issue 98 N10: calls were never counted
    for kwargs, message in (({"messages": deep}, "a tool call's arguments must be a JSON object"),
                            ({"messages": many}, "'messages' hold 257 tool calls; serve takes up to 256"),
                            ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(65)]},
                             "'tools' offers 65 functions"),
                            ({"tools": [{"type": "function", "function": {"name": ["f"]}}]}, "name must be a string")):
        with pytest.raises(openai.BadRequestError, match=message):  # each a 500 before
            client.chat.completions.create(**{"model": "tiny", "messages": hi, **kwargs})
    with pytest.raises(openai.NotFoundError, match="the model \"\\['tiny'\\]\" is not served"):
        client.chat.completions.create(model=["tiny"], messages=hi)


def test_a_page_on_another_site_cannot_post_to_the_api(served):
    """A cross-site POST (its Origin another site's) is refused, and so is a body a page may send without asking
    (text/plain): both would have run on the caller's behalf before; the same request from a program passes."""
    import urllib.error
    import urllib.request

    _, _, port = served
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()

    def post(headers):
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, method="POST",
                                         headers={"Authorization": "Bearer sk-api-key", **headers})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, said = post({"Content-Type": "application/json", "Origin": "https://evil.example"})
    assert status == 403 and "the page at https://evil.example" in said["error"]["message"]
    status, said = post({"Content-Type": "text/plain"})
    assert status == 415 and "Content-Type: application/json" in said["error"]["message"]
    status, said = post({"Content-Type": "application/json", "Origin": f"http://127.0.0.1:{port}"})
    assert status == 200 and said["choices"][0]["message"]["role"] == "assistant"


def test_a_client_over_its_share_is_told_to_wait(tmp_path, monkeypatch):
    """The API has its own per-client share: with a share of 0, a request is a 429 the client can act on."""
    monkeypatch.setattr(app, "API_PER_CLIENT", 0)
    port = free_port()
    server = app.serve(app.Served(["tiny"], []), app.Door(port=port), ab_db=str(tmp_path / "ab.sqlite"), block=False)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.RateLimitError, match="busy: you already have 0 answers being generated"):
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, stream=stream)
    finally:
        server.close()


@pytest.fixture(scope="module")
def caller(tmp_path_factory):
    """A tiny model fully fine-tuned until it answers 'Weather?' with one call, get_weather(city=Oslo), in the
    tool template the run recorded, and a 'tool' result with words; served alone."""
    from tunebench.jobs import finetune

    root = tmp_path_factory.mktemp("caller")
    data = weather_calls_file(root / "calls.jsonl")
    finetune.run(tiny_run_config(data, root / "run", **{"adapter.method": "full", "train.max_steps": 120,
                                                         "train.lr": 3e-3, "data.max_length": 512,
                                                         "data.eval_fraction": 0}))
    port = free_port()
    server = app.serve(app.Served([], [str(root / "run")]), app.Door(port=port), ab_db=str(root / "ab.sqlite"), block=False)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120), \
        str(root / "run")
    server.close()


def test_a_tools_request_gets_tool_calls_streamed_or_not_and_the_result_continues_the_chat(caller):
    client, run = caller
    ask = [{"role": "user", "content": "Weather?"}]
    reply = client.chat.completions.create(model=run, messages=ask, tools=WEATHER, max_tokens=120, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    # streamed: OpenAI's deltas, which the client's own accumulator puts back together
    with client.chat.completions.stream(model=run, messages=ask, tools=WEATHER, max_tokens=120, temperature=0) as s:
        final = s.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.choices[0].message.tool_calls] == \
        [("get_weather", {"city": "Oslo"})]
    # the call and its result sent back: the model answers in words
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": "rain"}]
    words = client.chat.completions.create(model=run, messages=follow, tools=WEATHER, max_tokens=16, temperature=0)
    assert words.choices[0].finish_reason == "stop" and words.choices[0].message.content == "Rain."
    # named: the call is forced to that function; none: no tools offered, so no call
    named = client.chat.completions.create(model=run, messages=ask, tools=WEATHER, max_tokens=120, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    plain = client.chat.completions.create(model=run, messages=ask, tools=WEATHER, max_tokens=120, temperature=0,
                                           tool_choice="none")
    assert plain.choices[0].finish_reason != "tool_calls" and not plain.choices[0].message.tool_calls
