"""The OpenAI-compatible API of `tunebench serve`, on the same server as the web app: GET /v1/models,
POST /v1/chat/completions and /v1/completions, streamed (server-sent events) or not.

The models are the app's: one Registry, so runs of one base share it as PEFT's named adapters and a request
picks one by its model name without reloading the base. The same limits as the page (message size, context,
512 new tokens, 2 answers at once per client), with a share and a bound of its own (the page stays answerable
while the API is saturated), a capped body, and its own key (`--api-key` or TUNEBENCH_API_KEY, sent as
`Authorization: Bearer KEY`), never the page's password. Written with FastAPI, which Gradio already serves on; the wire format is
OpenAI's (what the `openai` client, llama.cpp's server and Ollama speak), written by hand as no library here
provides its server side. No `from __future__ import annotations`: FastAPI reads a route's `request: Request`
annotation as the class itself to hand it the request, and Request is imported inside add_routes.
"""

import asyncio
import json
import secrets
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

from tunebench.core.errors import TunebenchError
from tunebench.data import formats, toolcalls
from tunebench.interfaces.web.models import MAX_NEW_TOKENS, Busy, Full, Registry, TooLong, stream

MAX_BODY = 2 ** 20  # bytes: a request within the message limits is a few hundred kilobytes at most
MAX_TOOLS = 64  # functions one request may offer (OpenAI's own limit is 128); each is rendered into the prompt
MAX_TOOLS_BYTES = 64 * 2 ** 10  # their schemas, as JSON: a prompt's worth
MAX_TOOL_CALLS = 256  # calls the assistant messages of one request may hold: each is parsed and rendered
FAILED_KEY_DELAY_S = 1.0  # a wrong key is answered after this, one at a time: guessing is slow


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def model_ids(registry: Registry) -> dict[str, str]:
    """The API's name of each model served -> its label: a base by its spec (`tiny`, `smollm2-135m-instruct`),
    a run or model directory by its path as given to serve."""
    out = {}
    for label, e in registry.choices.items():
        out[e.adapter or e.model or e.gguf or label] = label
    return out


# Settings of OpenAI's API that would change the answer and that serve does not do (the legacy functions, log
# probabilities, output formats, penalties, logit bias, echo, suffix, best_of)
UNSUPPORTED = ("functions", "function_call", "logprobs", "top_logprobs", "response_format",
               "presence_penalty", "frequency_penalty", "logit_bias", "echo", "suffix", "best_of", "audio",
               "modalities", "prediction")


def _tools(body: dict, messages: list) -> tuple[list | None, str | None]:
    """(tools, tool_choice) as OpenAI takes them: choice 'auto' (the default), 'none' (no tools offered),
    'required' (a call), or {"type": "function", "function": {"name": N}} (a call to N)."""
    given = body.get("tools")
    size = len(json.dumps(given)) if isinstance(given, list) else 0
    if isinstance(given, list) and (len(given) > MAX_TOOLS or size > MAX_TOOLS_BYTES):
        raise ApiError(400, f"'tools' offers {len(given)} functions in {size:,} bytes; serve takes up to {MAX_TOOLS} "
                       f"in {MAX_TOOLS_BYTES:,} bytes", param="tools")
    try:
        tools = formats.row_tools(given)
    except (TunebenchError, RecursionError) as e:
        raise ApiError(400, f"'tools': {e if isinstance(e, TunebenchError) else 'nested too deep'}",
                       param="tools") from None
    if tools and not all(isinstance(t["function"]["name"], str) for t in tools):
        raise ApiError(400, "'tools': each function's name must be a string", param="tools")
    choice = body.get("tool_choice") or "auto"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not tools or not isinstance(name, str) or name not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"'tool_choice' names {name!r}, which is not one of the request's tools",
                           param="tool_choice")
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise ApiError(400, f"'tool_choice' must be auto, none, required or a named function, got {choice!r}",
                       param="tool_choice")
    elif choice == "required" and not tools:
        raise ApiError(400, "'tool_choice' is required but the request offers no 'tools'", param="tool_choice")
    if choice == "none" or not tools:
        return None, None
    return tools, choice


def _messages(given: Any) -> list:
    """The chat's messages in the form training renders: system, user, assistant (its content, or its
    tool_calls), and tool (a call's result)."""
    ok = isinstance(given, list) and given and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant", "tool")
        and (isinstance(m.get("content"), str) or (m.get("role") == "assistant" and m.get("content") is None
                                                  and m.get("tool_calls"))) for m in given)
    if not ok:
        raise ApiError(400, "'messages' must be a non-empty list of {role: system|user|assistant|tool, content: text} "
                       "(an assistant's content may be null beside its tool_calls)", param="messages")
    calls = sum(len(c) if isinstance(c := m.get("tool_calls"), list) else 1 for m in given if "tool_calls" in m)
    if calls > MAX_TOOL_CALLS:  # counted before any is parsed: 15,000 in one message cost seconds of CPU
        raise ApiError(400, f"'messages' hold {calls:,} tool calls; serve takes up to {MAX_TOOL_CALLS} in one request",
                       param="messages")
    try:
        return [formats.message(m, n) for n, m in enumerate(given, 1)]
    except TunebenchError as e:
        raise ApiError(400, f"'messages': {e}", param="messages") from None
    except (RecursionError, TypeError, AttributeError):  # a call's arguments nested too deep, or not an object
        raise ApiError(400, "'messages': a tool call's arguments must be a JSON object as a string, nested no deeper "
                       "than JSON's usual depth", param="messages") from None


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(400, f"'{key}' must be a number from {low:g} to {high:g}, got {value!r}", param=key)
    return float(value)


def parse(body: Any, registry: Registry, chat: bool) -> dict[str, Any]:
    """A request's settings, checked before anything loads; OpenAI's defaults where it leaves one out."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    ids = model_ids(registry)
    model = body.get("model")
    if not isinstance(model, str) or model not in ids:
        raise ApiError(404, f"the model {str(model)[:80]!r} is not served here; GET /v1/models lists: {', '.join(ids)}",
                       param="model", code="model_not_found")
    tools, choice = None, None
    if chat:
        messages = _messages(body.get("messages"))
        tools, choice = _tools(body, messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' must be a string (one prompt a request)", param="prompt")
        messages = [{"role": "user", "content": prompt}]
    if body.get("n", 1) not in (1, None):
        raise ApiError(400, "'n' must be 1: one answer a request", param="n")
    for key in UNSUPPORTED:  # what would change the answer is refused, never silently dropped
        value = body.get(key)
        if value not in (None, False, 0, [], {}, "") and not (key == "response_format" and value == {"type": "text"}):
            raise ApiError(400, f"'{key}' is not supported by tunebench serve; leave it out", param=key)
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    limit = MAX_NEW_TOKENS if limit is None else limit
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_NEW_TOKENS:
        raise ApiError(400, f"'max_tokens' must be a whole number from 1 to {MAX_NEW_TOKENS}, got {limit!r}",
                       param="max_tokens")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of up to 4 non-empty strings", param="stop")
    seed = body.get("seed", 0)
    if seed is None:
        seed = 0
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise ApiError(400, f"'seed' must be a whole number from 0 to 2**63 - 1, got {str(seed)[:40]}", param="seed")
    stream_ = body.get("stream", False)
    if stream_ is not None and not isinstance(stream_, bool):
        raise ApiError(400, f"'stream' must be true or false, got {stream_!r}", param="stream")
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' must be an object such as {\"include_usage\": true}",
                       param="stream_options")
    return {"model": model, "label": ids[model], "messages": messages, "max_tokens": limit, "stop": stop,
            "temperature": _number(body, "temperature", 1.0, 0.0, 2.0), "top_p": _number(body, "top_p", 1.0, 0.0, 1.0),
            "seed": seed, "stream": bool(stream_), "usage_in_stream": bool((options or {}).get("include_usage", False)),
            "chat": chat, "tools": tools, "tool_choice": choice}


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the first stop sequence in it, and whether one was found."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(ends)], True) if ends else (text, False)


def _tool_prompt(request: dict[str, Any]):
    """With tools: the prompt in a template that renders them (data.toolcalls.serving_template), then the start
    of the call where one is forced; the answer's text includes that start."""
    messages, tools, choice = request["messages"], request["tools"], request["tool_choice"]
    # a forced call's reply starts as the tool template begins one: any function, or the one named
    start = "" if choice == "auto" else toolcalls.CALL_START + ('"' if choice == "required" else
                                                               json.dumps(choice) + ', "arguments": ')

    def prompt(tok) -> str:
        template = toolcalls.serving_template(messages, tools, tok)
        return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                       add_generation_prompt=True) + start
    return prompt, start


def answer(registry: Registry, request: dict[str, Any]) -> Iterator[tuple[str, dict | None]]:
    """The answer's text as it grows, then (text, usage and finish reason) once it ends. A stop sequence ends
    the generation where it appears (closing the stream stops the model) and is not part of the text."""
    text = ""
    prompt, start = _tool_prompt(request) if request.get("tools") else (None, "")
    replies = stream(registry, request["label"], request["messages"], request["max_tokens"], request["temperature"],
                     request["top_p"], request["seed"], raw=not request["chat"], prompt=prompt)
    try:
        for reply in replies:
            cut, stopped = _cut(start + reply.text, request["stop"])
            if stopped:
                replies.close()  # the model stops here
                tokenizer = registry.get(request["label"])[0].tokenizer
                done = len(tokenizer(cut, add_special_tokens=False).input_ids)
                yield cut, {"finish_reason": "stop", "prompt_tokens": reply.prompt_tokens, "completion_tokens": done}
                return
            text = cut
            if reply.done:
                reason = "stop" if reply.ended else "length"
                yield text, {"finish_reason": reason, "prompt_tokens": reply.prompt_tokens,
                             "completion_tokens": reply.new_tokens}
                return
            yield text, None
    except TooLong as e:
        raise ApiError(400, str(e), code="context_length_exceeded") from None


def _usage(end: dict) -> dict[str, int]:
    return {"prompt_tokens": end["prompt_tokens"], "completion_tokens": end["completion_tokens"],
            "total_tokens": end["prompt_tokens"] + end["completion_tokens"]}


def calls_of(text: str, request: dict[str, Any]) -> tuple[str | None, list[dict]]:
    """An answer to a request with tools: its text (None when it is only calls) and its calls in OpenAI's form
    (arguments a JSON string); no calls where the request offers no tools."""
    if not request.get("tools"):
        return text, []
    said, calls = toolcalls.parse(text)
    return (said or None) if calls else text, [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}} for c in calls]


def complete(registry: Registry, request: dict[str, Any]) -> dict[str, Any]:
    """The whole answer as one response object."""
    text, end = "", None
    for piece in answer(registry, request):  # the last piece is the whole answer and its end
        text, end = piece
    created, model = int(time.time()), request["model"]
    if request["chat"]:
        content, calls = calls_of(text, request)
        message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else
                             end["finish_reason"], "logprobs": None}], "usage": _usage(end)}
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": end["finish_reason"], "logprobs": None}],
            "usage": _usage(end)}


def events(registry: Registry, request: dict[str, Any]) -> Iterator[str]:
    """The answer as server-sent events: a chunk per new piece of text, the finish reason, the usage if asked
    (stream_options.include_usage), then [DONE]."""
    chat, model, created = request["chat"], request["model"], int(time.time())
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(piece: str | None, finish: str | None, first: bool = False, calls: list | None = None) -> str:
        if chat:
            delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": piece} if piece else {}) | \
                ({"tool_calls": [{"index": i} | c for i, c in enumerate(calls)]} if calls else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": piece or "", "finish_reason": finish, "logprobs": None}
        return _event({"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]})

    sent = ""
    if chat:
        yield chunk(None, None, first=True)
    tools = bool(request.get("tools"))
    try:
        for whole, end in answer(registry, request):
            text, calls = whole, []
            if tools:  # the text before a call streams; a call goes whole once it ends (one delta, as OpenAI may)
                text, calls = calls_of(whole, request) if end is not None else (_before_call(whole), [])
                text = text or ""
            if text.startswith(sent) and len(text) > len(sent):
                yield chunk(text[len(sent):], None)
                sent = text
            if end is not None:
                if calls:
                    yield chunk(None, None, calls=calls)
                yield chunk(None, "tool_calls" if calls else end["finish_reason"])
                if request["usage_in_stream"]:
                    yield _event({"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                                  "usage": _usage(end)})
    except ApiError as e:  # the status line is sent already: the error travels as an event
        yield _event(e.body())
    except Busy as e:  # waited past its time for the generations ahead of it: the server's load, not the request
        yield _event(ApiError(503, str(e), kind="server_error", code="overloaded").body())
    except TunebenchError as e:
        yield _event(ApiError(400, str(e)).body())
    yield _event("[DONE]")


def _before_call(text: str, tag: str = "<tool_call>") -> str:
    """The text ahead of a tool call, and ahead of a tail that may be the start of one."""
    at = text.find(tag)
    if at >= 0:
        return text[:at]
    held = next((k for k in range(min(len(text), len(tag) - 1), 0, -1) if tag.startswith(text[-k:])), 0)
    return text[:len(text) - held]


def _event(data: dict | str) -> str:
    """One server-sent event: an object as JSON, or OpenAI's closing [DONE] as it is."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def check_key(authorization: str | None, key: str | None, locked: bool) -> None:
    """With an API key, a request must send it as a Bearer token; without one, the API is open where the page is
    (`locked`: the page has a login, and the API no key of its own, so it is closed)."""
    if key is None:
        if locked:
            raise ApiError(401, "this server's page has a login and its API no key: start it with --api-key KEY (or "
                                "TUNEBENCH_API_KEY) to open the API", kind="authentication_error",
                           code="invalid_api_key")
        return
    scheme, _, sent = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(sent.strip().encode(), key.encode()):
        raise ApiError(401, "this server needs its API key (serve's --api-key), as 'Authorization: Bearer KEY'",
                       kind="authentication_error", code="invalid_api_key")


# The body types a page on another site may POST without the browser asking first (CORS "simple requests")
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


def check_origin(headers) -> None:
    """A POST from a page on another site is refused: its Origin must be this server's (browsers send it on every
    cross-site POST; clients such as `openai` send none), and its body must be declared JSON, which a page elsewhere
    cannot send without the browser asking this server first (and the server never says yes)."""
    origin, host = headers.get("origin"), headers.get("host")
    if origin is not None and urllib.parse.urlsplit(origin).netloc != host:
        raise ApiError(403, f"a request from the page at {origin[:100]} to this server is refused: the API answers "
                       "this server's own pages and programs, not other sites'", kind="permission_error")
    kind = (headers.get("content-type") or "").split(";")[0].strip().lower()
    if kind in SIMPLE_TYPES:
        raise ApiError(415, f"the body is sent as {kind}; send it as JSON with 'Content-Type: application/json'")


async def read_body(request) -> Any:
    """The request's JSON, read up to MAX_BODY bytes (a larger one is refused as it arrives, not after)."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_BODY):
        raise ApiError(413, f"the request body is over {MAX_BODY:,} bytes")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the request body is over {MAX_BODY:,} bytes")
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not JSON") from None


def add_routes(fastapi_app, registry: Registry, key: str | None, locked: bool, limit, pending, client_of) -> None:
    """Put the API's routes on the FastAPI app the web app runs on. `key`, `locked`: see check_key. `limit` is the
    API's own ClientLimit (one client's share), `pending` its Pending (everyone's generations waiting or running);
    `client_of` names a request's client."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool

    started = int(time.time())
    failures = asyncio.Lock()

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status,
                            headers={"Retry-After": "5"} if e.status in (429, 503) else None)

    async def authorized(request: Request) -> None:
        try:
            check_key(request.headers.get("authorization"), key, locked)
        except ApiError:
            async with failures:  # one wrong key a second, whoever sends them
                await asyncio.sleep(FAILED_KEY_DELAY_S)
            raise

    def busy(e: Busy) -> ApiError:
        return ApiError(503, str(e), kind="server_error", code="overloaded") if isinstance(e, Full) else \
            ApiError(429, str(e), kind="rate_limit_error")

    async def models_route(request: Request):
        try:
            await authorized(request)
        except ApiError as e:
            return error(e)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": started, "owned_by": "tunebench"}
                                           for name in model_ids(registry)]}

    def generation(chat: bool):
        async def route(request: Request):
            try:
                check_origin(request.headers)
                await authorized(request)
                parsed = parse(await read_body(request), registry, chat)
            except ApiError as e:
                return error(e)
            client = client_of(request)
            if parsed["stream"]:
                try:  # over the share or the bound: a 429/503 now, rather than an error event after a 200
                    limit.check(client)
                    pending.check()
                except Busy as e:
                    return error(busy(e))

                def sse():
                    try:
                        with pending.hold(), limit.hold(client):
                            yield from events(registry, parsed)
                    except Busy as e:  # another request took the place meanwhile
                        yield _event(busy(e).body())
                        yield _event("[DONE]")
                return StreamingResponse(sse(), media_type="text/event-stream")

            def whole():
                with pending.hold(), limit.hold(client):
                    return complete(registry, parsed)
            try:
                return await run_in_threadpool(whole)
            except ApiError as e:
                return error(e)
            except Busy as e:
                return error(busy(e))
            except TunebenchError as e:  # a limit the request ran into
                return error(ApiError(400, str(e)))
        return route

    fastapi_app.add_api_route("/v1/models", models_route, methods=["GET"])
    fastapi_app.add_api_route("/v1/chat/completions", generation(True), methods=["POST"])
    fastapi_app.add_api_route("/v1/completions", generation(False), methods=["POST"])
