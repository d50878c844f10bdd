"""What `tunebench serve` offers: base models and run directories, each loaded once and shared by
every browser session, and streamed generation with its tokens/s. No Gradio here: tested on its own."""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tunebench.core.errors import TunebenchError
from tunebench.data.tokenize import render_prompt
from tunebench.jobs.generate import trained_template
from tunebench.model import gguf_runtime, inference, models
from tunebench.settings.rundir import RunDir


@dataclass(frozen=True)
class Entry:
    label: str  # what the page shows and the A/B database stores
    model: str | None  # a base model spec, or a model directory (merged, full fine-tune, pretrained)
    adapter: str | None  # a run directory holding a PEFT adapter
    gguf: str | None = None  # an exported file, answered by llama.cpp


def entries(model_specs: list[str], run_dirs: list[str], allow_download: bool = False,
            ggufs: list[str] = ()) -> list[Entry]:
    """The choices, checked before anything loads: every run directory must hold a model or an adapter, every
    GGUF must be an export inside its run."""
    out: list[Entry] = []
    for spec in model_specs:
        models.check_spec(spec, allow_download)
        out.append(Entry(f"base: {spec}", spec, None))
    for d in run_dirs:
        run = RunDir(d)
        if run.kind() == "adapter":
            method = (run.peft_type() or "adapter").lower()
            out.append(Entry(f"run: {d} ({method.replace('_', ' ')})", None, d))
        elif (run.path / "config.json").is_file():
            out.append(Entry(f"model: {d}", d, None))
        else:
            raise TunebenchError(f"'{d}' holds no model (no adapter_config.json or config.json); point --adapter at "
                                 "a finished training, merge or pretraining --output-dir")
    for path in ggufs:
        gguf_runtime.check(path)
        out.append(Entry(f"gguf: {path} (llama.cpp)", None, None, path))
    labels = [e.label for e in out]
    if len(set(labels)) != len(labels):
        raise TunebenchError("the same model or run is listed twice; list each once")
    return out


MAX_LOADED = 3  # distinct models in memory at once (a shared base counts once); the least recently used goes


class Registry:
    """Models load on first use, once, whatever the number of sessions asking; one generation runs at a
    time (two at once would only split the same cores, and the tokens/s shown would be wrong). At most
    MAX_LOADED models stay loaded: a page offering every finished run (the studio's) would otherwise keep each
    one picked in memory for the server's life."""

    def __init__(self, choices: list[Entry], allow_download: bool = False, device: str = "auto",
                 precision: str = "auto"):
        self.choices = {e.label: e for e in choices}
        self.allow_download = allow_download
        self.device, self.precision, self.placement = inference.placement(device, precision)
        self._loaded: dict[str, tuple[inference.Placed, str]] = {}
        # Adapters of one base and one PEFT type share one loaded base, as PEFT's named adapters: the
        # base's memory once, whatever the number of runs served; `activate` picks one before generating.
        self._shared: dict[tuple[str, str], inference.Placed] = {}
        self._adapter_name: dict[str, str] = {}
        self._names = itertools.count()  # adapter names on a shared base: never reused, whatever is evicted
        self._used: dict[int, float] = {}  # id(model) -> when a request last got it
        self._load_lock = threading.Lock()
        self.generate_lock = threading.Lock()
        self.in_use: int | None = None  # id of the model the running generation decodes on: never evicted

    @property
    def labels(self) -> list[str]:
        return list(self.choices)

    def add(self, entry: Entry) -> str:
        """A model or run offered from now on (the studio's finished runs); its label. Loads on first use."""
        with self._load_lock:
            self.choices.setdefault(entry.label, entry)
        return entry.label

    def get(self, label: str, generating: bool = False) -> tuple[inference.Placed, str]:
        """(the model, placed as it trained, and its prompt template). `generating`: the caller decodes on it now
        (holding generate_lock), so no other load evicts it until `done_generating`."""
        if label not in self.choices:
            raise TunebenchError(f"no model named {label!r} is served; pick one of the list")
        with self._load_lock:
            got = self._get(label)
            if generating:
                self.in_use = id(got[0].model)
            return got

    def done_generating(self) -> None:
        self.in_use = None

    def _get(self, label: str) -> tuple[inference.Placed, str]:
        """The model of `label`, loaded (under _load_lock) where it is not, evicting others first."""
        if label not in self._loaded:
            self._evict(keep=MAX_LOADED - 1)
            e = self.choices[label]
            group = _group(e)
            if e.gguf is not None:

                placed = gguf_runtime.GgufPlaced.load(e.gguf)
                self._loaded[label] = (placed, trained_template(str(gguf_runtime.run_of(Path(e.gguf)))))
                self._used[id(placed.model)] = time.monotonic()
                return self._loaded[label]
            if group in self._shared:  # its base is loaded: add the adapter to it, by name
                shared = self._shared[group]
                name = f"run_{next(self._names)}"
                shared.model.load_adapter(e.adapter, adapter_name=name)  # its weights in fp32, as trained
                tokenizer = models.load_tokenizer(e.adapter) if (Path(e.adapter) / "tokenizer_config.json"
                                                                  ).is_file() else shared.tokenizer
                loaded = inference.place(models.Loaded(
                    shared.model, tokenizer, f"{shared.source.split(' + adapter ')[0]} + adapter {e.adapter}",
                    None), self.device, self.precision)
            else:
                loaded = inference.load(e.model, e.adapter, None, self.allow_download, self.device,
                                        self.precision)
                name = "default"
                if group is not None:
                    self._shared[group] = loaded
            if group is not None:
                self._adapter_name[label] = name
            self._loaded[label] = (loaded, trained_template(e.adapter, e.model))
        self._used[id(self._loaded[label][0].model)] = time.monotonic()
        return self._loaded[label]

    def _evict(self, keep: int) -> None:
        """Drop the least recently used models until `keep` remain (with _load_lock held): every label on one,
        and the base it shares; never the model a generation decodes on now (in_use), which may leave one more
        than `keep` while it runs. (Eviction used to wait for no generation to run, so under steady traffic every
        model asked for stayed loaded.)"""
        while self.bases_loaded() > keep:
            loaded = {id(p.model) for p, _ in self._loaded.values()} - {self.in_use}
            if not loaded:
                return
            oldest = min(loaded, key=lambda m: self._used.get(m, 0.0))
            for label in [k for k, (p, _) in self._loaded.items() if id(p.model) == oldest]:
                del self._loaded[label]
                self._adapter_name.pop(label, None)
            for group in [g for g, p in self._shared.items() if id(p.model) == oldest]:
                del self._shared[group]
            self._used.pop(oldest, None)

    def activate(self, label: str) -> None:
        """Point a shared base at this run's adapter (called with generate_lock held)."""
        if label in self._adapter_name:
            self._loaded[label][0].model.set_adapter(self._adapter_name[label])

    def bases_loaded(self) -> int:
        """Distinct model objects in memory (a shared base counts once)."""
        return len({id(loaded.model) for loaded, _ in self._loaded.values()})


def _group(e: Entry) -> tuple[str, str] | None:
    """(base model, PEFT type) of an adapter entry: the runs that can share a loaded base; None otherwise."""
    if e.adapter is None or e.model is not None or e.gguf is not None:
        return None
    run = RunDir(e.adapter)
    peft_type, base = run.peft_type() or "", run.base_model()
    return (str(Path(base).resolve()) if Path(base).exists() else base), peft_type


@dataclass
class Reply:
    text: str
    new_tokens: int = 0
    seconds: float = 0.0
    done: bool = False
    prompt_tokens: int = 0
    ended: bool = False  # the model ended its answer itself (EOS), rather than running into the token limit
    runtime: str = "PyTorch"  # what answered: tunebench's decoding loop, or llama.cpp running an export

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


LOCK_WAIT_S = 300  # a generation waits this long for the ones ahead of it, then is told "busy"
MAX_NEW_TOKENS = 512  # per answer, whatever a client sends: the page's slider stops there too
MAX_PROMPT_CHARS = 8_000  # a message, and a whole conversation's text at 4x that
MAX_MESSAGES = 200  # in one conversation


class TooLong(TunebenchError):
    """A request the server refuses for its size (said to the client, not a crash)."""


def check_request(messages: list[dict[str, str]]) -> None:
    """Bound what one visitor can ask for before anything is tokenized: the browser's own limits are
    only advice, so the server checks again."""
    if len(messages) > MAX_MESSAGES:
        raise TooLong(f"the conversation holds {len(messages):,} messages; the limit is {MAX_MESSAGES}")
    if any(not isinstance(m.get("content"), str) for m in messages):
        raise TooLong("every message must be text")
    if len(messages[-1]["content"]) > MAX_PROMPT_CHARS:
        raise TooLong(f"the message is {len(messages[-1]['content']):,} characters; the limit is {MAX_PROMPT_CHARS:,}")
    total = sum(len(m["content"]) for m in messages)
    if total > 4 * MAX_PROMPT_CHARS:
        raise TooLong(f"the conversation holds {total:,} characters, over the {4 * MAX_PROMPT_CHARS:,} a chat may "
                      "reach; clear it and start again")


def stream(registry: Registry, label: str, messages: list[dict[str, str]], max_new_tokens: int = 128,
           temperature: float = 0.7, top_p: float = 0.9, seed: int = 0, raw: bool = False,
           prompt: Callable[[Any], str] | None = None) -> Iterator[Reply]:
    """The reply to the chat `messages`, as it grows; the last one has done=True and its tokens/s
    (new tokens over the decoding's time, prompt processing included, waiting for the lock not). A conversation
    that does not fit the model's context is refused; a consumer that closes the stream (a closed tab) stops the
    generation, and one that only stops reading holds nothing: the generation lock is the decoding's alone."""
    from transformers import TextIteratorStreamer


    check_request(messages)
    max_new_tokens = max(1, min(int(max_new_tokens), MAX_NEW_TOKENS))
    placed, template = registry.get(label)
    tok = placed.tokenizer
    # `prompt`: the request's own rendering, from the tokenizer (the API's requests with tools)
    enc = placed.encode(prompt(tok) if prompt else messages[-1]["content"] if raw else
                        render_prompt(messages, tok, template))
    n_prompt = enc["input_ids"].shape[1]
    limit = placed.context_limit()
    if limit is not None:
        if n_prompt >= limit:
            raise TooLong(f"the conversation is {n_prompt:,} tokens, and this model sees {limit:,}; clear the chat or "
                          "shorten the prompt")
        max_new_tokens = min(max_new_tokens, limit - n_prompt)
    # The decoding runs in a worker that holds the generation lock only while it decodes; the text goes through
    # the streamer's queue, so a client that stops reading (and so stops pulling from this generator) holds no
    # lock: the next request decodes meanwhile, and this one's text waits in the queue (max_new_tokens at most).
    streamer = TextIteratorStreamer(tok, skip_special_tokens=True, timeout=LOCK_WAIT_S + 600)  # the new tokens only
    stop, decoding = threading.Event(), threading.Event()
    sampling = temperature > 0
    result: dict[str, object] = {}

    def each(token: torch.Tensor) -> bool:
        streamer.put(token.cpu())
        return stop.is_set()

    def run() -> None:
        try:
            if not registry.generate_lock.acquire(timeout=LOCK_WAIT_S):
                raise Full(f"busy: the server has been generating for others for {LOCK_WAIT_S} s; try again later")
            try:
                if stop.is_set():  # the client left while this request waited
                    return
                decoding.set()
                # the model as loaded now (evicted and loaded again since, maybe), kept loaded while it decodes
                now = registry.get(label, generating=True)[0]
                registry.activate(label)
                now.reseed(seed)
                t0 = time.perf_counter()
                result["ids"] = now.decode(  # in this thread: autocast is per thread
                    enc["input_ids"], enc["attention_mask"], max_new_tokens, temperature if sampling else None,
                    top_p if sampling else 1.0, each=each)
                result["seconds"] = time.perf_counter() - t0
            finally:
                registry.done_generating()
                registry.generate_lock.release()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = e
        finally:
            streamer.end()

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    text = ""
    try:
        for piece in streamer:
            text += piece
            yield Reply(text.strip(), prompt_tokens=n_prompt)
    finally:  # also when the consumer closes this generator (GeneratorExit): no orphan generation
        stop.set()
        if decoding.is_set():  # it stops at its next token; one still waiting for the lock ends by itself
            worker.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    ids = result["ids"][0].tolist()  # type: ignore[index]
    ended = tok.eos_token_id is not None and tok.eos_token_id in ids
    yield Reply(text.strip(), len(ids), float(result["seconds"]), done=True, prompt_tokens=n_prompt, ended=ended,
                runtime=placed.runtime)


class Busy(TunebenchError):
    pass


def client_of(request) -> str:
    """Who sends a request (Gradio's, or the API's Starlette one): the login where there is one, else the address
    it comes from."""
    if request is None:
        return "local"
    user = getattr(request, "username", None)
    host = getattr(getattr(request, "client", None), "host", None)
    return f"user:{user}" if user else f"host:{host or 'unknown'}"


PER_CLIENT = 2  # generations one visitor may have running or waiting at once (the Chat and A/B tabs, say)


class ClientLimit:
    """At most `limit` generations at once per client (its login, else its address): one visitor cannot
    hold every worker while the others wait. A request over the limit is answered "busy" at once, so a
    burst from one client drains from the queue in no time instead of holding it."""

    def __init__(self, limit: int):
        self.limit = limit
        self._running: Counter[str] = Counter()
        self._lock = threading.Lock()

    def check(self, client: str) -> None:
        """Busy if `client` is at its share now (hold() still decides, under the lock)."""
        with self._lock:
            self._refuse_at_limit(client)

    def _refuse_at_limit(self, client: str) -> None:
        if self._running[client] >= self.limit:
            raise Busy(f"busy: you already have {self.limit} answers being generated; wait for them to finish, "
                       "then send this again")

    @contextlib.contextmanager
    def hold(self, client: str):
        with self._lock:
            self._refuse_at_limit(client)
            self._running[client] += 1
        try:
            yield
        finally:
            with self._lock:
                self._running[client] -= 1
                if not self._running[client]:
                    del self._running[client]


class Pending:
    """At most `limit` generations waiting or running at once, from everyone (the API's bound: each waiting
    request holds one of the server's shared worker threads, so an unbounded line of them starves the page and
    then everything). Past it, a request is told at once to come back, never queued for hours."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0
        self._lock = threading.Lock()

    def check(self) -> None:
        """Full if the bound is reached now (hold() still decides, under the lock)."""
        with self._lock:
            self._refuse_at_limit()

    def _refuse_at_limit(self) -> None:
        if self.count >= self.limit:
            raise Full(f"the server is busy: {self.count} answers are being generated or waiting; retry in a "
                       "few seconds")

    @contextlib.contextmanager
    def hold(self):
        with self._lock:
            self._refuse_at_limit()
            self.count += 1
        try:
            yield
        finally:
            with self._lock:
                self.count -= 1


class Full(Busy):
    """Every client's generations together are at the bound (HTTP 503), as against one client's share (429)."""


PROMPT_COLUMNS = ("prompt", "instruction", "question", "text", "input")


def load_prompts(path: str | Path) -> list[str]:
    """Prompts from a JSONL or CSV file (a `prompt`, `instruction`, `question`, `text` or `input` field,
    else the first text field), such as a dataset's held-out rows."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TunebenchError(f"prompt file '{p}' cannot be read ({getattr(e, 'strerror', None) or e}); "
                             "check the path") from e
    rows: list[dict] = []
    try:
        if p.suffix.lower() in (".jsonl", ".json"):
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        elif p.suffix.lower() == ".csv":
            rows = list(csv.DictReader(text.splitlines()))
        else:
            raise TunebenchError(f"prompt file '{p}' is neither .jsonl nor .csv; give one of those")
    except (json.JSONDecodeError, csv.Error) as e:
        raise TunebenchError(f"prompt file '{p}' does not parse ({e}); fix the file") from e
    prompts = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        key = next((k for k in PROMPT_COLUMNS if isinstance(row.get(k), str) and row[k].strip()), None)
        key = key or next((k for k, v in row.items() if isinstance(v, str) and v.strip()), None)
        if key:
            prompts.append(row[key].strip())
    if not prompts:
        raise TunebenchError(f"prompt file '{p}' holds no prompts; give rows with a prompt or instruction field")
    return prompts
