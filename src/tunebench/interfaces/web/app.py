"""`tunebench serve`: a Gradio app with a chat tab, a blind A/B tab and the A/B results (their work is chat_ab.py's,
Gradio-free), its exposure checked, its login, and the server started.

Gradio runs these (sync, generator) handlers on its worker threads, so generation never blocks the
server's event loop; models come from one Registry shared by every session.

No `from __future__ import annotations` here: Gradio hands a handler the visitor's request when its
parameter is annotated gr.Request, and finds that by evaluating the annotation, which a string naming a
module imported inside build() would defeat.
"""

import asyncio
import atexit
import contextlib
import importlib.util
import os
import secrets
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tunebench.core.errors import TunebenchError
from tunebench.core.jsonfile import read_json, write_json
from tunebench.data import votes
from tunebench.interfaces.web import openai_api, studio_tabs
from tunebench.interfaces.web.chat_ab import (
    AB_MIN_TEMPERATURE,
    VOTE_LABELS,
    Blinded,
    ab_answers,
    ab_vote,
    chat_feedback,
    chat_turn,
    read_upload,
    results_rows,
    train_on_votes,
)
from tunebench.interfaces.web.models import (
    MAX_PROMPT_CHARS,
    PER_CLIENT,
    Busy,
    ClientLimit,
    Pending,
    Registry,
    client_of,
    entries,
    load_prompts,
)
from tunebench.interfaces.web.studio import Studio
from tunebench.settings.rundir import RunDir


def check_port(host: str, port: int) -> None:
    """The port is free on `host`, in the host's own address family (an IPv6 host such as ::1 was tried as
    IPv4 and reported as a port in use); a host that does not resolve is said as that."""
    if isinstance(port, bool) or not 1 <= port <= 65535:
        raise TunebenchError(f"--port {port} is not a port number; pass one from 1 to 65535, e.g. --port 7860")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise TunebenchError(f"--host {host} is not an address of this machine ({e.strerror}); pass e.g. "
                             "--host 127.0.0.1") from e
    with socket.socket(family, kind, proto) as s:
        try:
            s.bind(address)
        except OSError as e:
            raise TunebenchError(f"port {port} on {host} is in use or not ours ({e.strerror}); pass --port with a "
                                 "free one, e.g. --port 7861") from e


def build(registry: Registry, db: Path, prompts: list[str] | None = None, limit: ClientLimit | None = None,
          studio=None):
    """The page: Chat, A/B and its results, and (with a `studio`, interfaces/web/studio.py) Train and Runs."""
    import gradio as gr

    page = _Page(gr, registry, db, limit or ClientLimit(PER_CLIENT))
    results_head = votes.table(db)[0] if db.is_file() else []
    # delete_cache: the live view's charts and the uploads' copies go after an hour, not at the server's end
    with gr.Blocks(title="tunebench", analytics_enabled=False, delete_cache=(600, 3600)) as app:
        gr.Markdown("# tunebench\nTalk to base models and fine-tuned runs, compare them blind"
                    + (", and train new ones." if studio else "."))
        with gr.Tabs() as tabs:
            chat_model = _chat_tab(page)
            first, second = _ab_tab(page, prompts)
            _results_tab(page, results_head)
            if studio is not None:

                studio_tabs.add_tabs(gr, studio, registry, tabs, chat_model, first, second, db)
    return app


class _Page:
    """What the tabs' handlers share: Gradio, the models, the votes' database, the blinding of A/B pairs and each
    client's share of the workers."""

    def __init__(self, gr, registry: Registry, db: Path, limit: ClientLimit):
        self.gr, self.registry, self.db, self.limit, self.blinded = gr, registry, db, limit, Blinded()

    @contextlib.contextmanager
    def said(self):
        """chat_ab's one-line problems (too long, an unknown model, a pair voted on) shown to the visitor as
        Gradio's errors; anything else stays in the server's console."""
        try:
            yield
        except TunebenchError as e:
            raise self.gr.Error(str(e)) from None

    def limited(self, request, handler, *args):
        """`handler`'s answers, within the client's share of the workers; over it, "busy" at once."""
        try:
            with self.said(), self.limit.hold(client_of(request)):
                yield from handler(*args)
        except Busy as e:
            raise self.gr.Error(str(e)) from None


def _chat_tab(page: _Page):
    """The Chat tab: one model, a conversation, thumbs up or down on an answer (a KTO judgement); its model picker."""
    gr = page.gr
    with gr.Tab("Chat", id="chat"):
        with gr.Row():
            chat_model = gr.Dropdown(page.registry.labels, value=page.registry.labels[-1], label="Model", scale=3)
            chat_temp = gr.Slider(0, 1.5, value=0.7, step=0.05, label="Temperature", scale=1)
            chat_top_p = gr.Slider(0.05, 1, value=0.9, step=0.05, label="Top-p", scale=1)
            chat_max = gr.Slider(8, 512, value=128, step=8, label="Max new tokens", scale=1)
        # Plain text, not Markdown: a reply cannot make the browser fetch a remote image (offline; no tracking).
        chatbot = gr.Chatbot(label="Conversation", height=380,
                             buttons=["copy", "copy_all"],  # no share: offline
                             render_markdown=False, sanitize_html=True)
        chat_history = gr.State([])
        with gr.Row():
            chat_box = gr.Textbox(placeholder="Ask something, then Enter", show_label=False, scale=5,
                                  max_length=MAX_PROMPT_CHARS)
            chat_send = gr.Button("Send", variant="primary", scale=1)
            chat_clear = gr.Button("Clear", scale=1)
        chat_status = gr.Markdown("")

        def on_chat(label, message, history, temp, top_p, max_new, request: gr.Request):
            for shown, status in page.limited(request, chat_turn, page.registry, label, message, history, temp,
                                              top_p, max_new, page.blinded):
                yield shown, shown, "", status

        chat_inputs = [chat_model, chat_box, chat_history, chat_temp, chat_top_p, chat_max]
        chat_outputs = [chatbot, chat_history, chat_box, chat_status]
        chat_send.click(on_chat, chat_inputs, chat_outputs)
        chat_box.submit(on_chat, chat_inputs, chat_outputs)
        chat_clear.click(lambda: ([], [], ""), None, [chatbot, chat_history, chat_status])
        chat_model.change(lambda: ([], [], ""), None, [chatbot, chat_history, chat_status])
        chatbot.clear(lambda: ([], ""), None, [chat_history, chat_status])  # its own trash button

        def on_like(label, history, temp, top_p, max_new, data: gr.LikeData):
            index = data.index[0] if isinstance(data.index, (list, tuple)) else data.index
            with page.said():
                return chat_feedback(page.db, label, history, int(index), bool(data.liked), temp, top_p, max_new)

        chatbot.like(on_like, [chat_model, chat_history, chat_temp, chat_top_p, chat_max], [chat_status])
    return chat_model


def _ab_tab(page: _Page, prompts: list[str] | None):
    """The A/B tab: one prompt to two models, their answers blind, a vote; its two model pickers."""
    gr = page.gr
    with gr.Tab("A/B", id="ab"):
        gr.Markdown("The same prompt goes to both models; their answers appear as **A** and **B** in random "
                    "order. Vote, and the models are revealed.")
        with gr.Row():
            first = gr.Dropdown(page.registry.labels, value=page.registry.labels[0], label="Model 1")
            second = gr.Dropdown(page.registry.labels, value=page.registry.labels[-1], label="Model 2")
        with gr.Row():
            ab_temp = gr.Slider(AB_MIN_TEMPERATURE, 1.5, value=0.7, step=0.05, label="Temperature")
            ab_top_p = gr.Slider(0.05, 1, value=0.9, step=0.05, label="Top-p")
            ab_max = gr.Slider(8, 512, value=128, step=8, label="Max new tokens")
        prompt_set = gr.State(list(prompts or []))
        prompt_index = gr.State(-1)
        with gr.Accordion("Prompt set: step through a fixed list of prompts", open=bool(prompts)):
            with gr.Row():
                prompt_file = gr.File(label="Prompt set (JSONL or CSV)", file_types=[".jsonl", ".csv"], scale=2,
                                      height=110)
                with gr.Column(scale=1):
                    next_prompt = gr.Button("Next prompt from the set")
                    set_status = gr.Markdown(f"{len(prompts)} prompts loaded" if prompts
                                             else "No prompt set loaded")
        ab_prompt = gr.Textbox(label="Prompt", lines=2,
                               placeholder="Type a prompt, or take the next from the set",
                               max_length=MAX_PROMPT_CHARS)
        ab_go = gr.Button("Get answers", variant="primary")
        with gr.Row():
            answer_a = gr.Textbox(label="A", lines=8, interactive=False)
            answer_b = gr.Textbox(label="B", lines=8, interactive=False)
        ab_state = gr.State(None)
        with gr.Row():
            vote_buttons = {v: gr.Button(text) for v, text in VOTE_LABELS.items()}
        ab_status = gr.Markdown("")

        def on_file(file):
            if file is None:
                return gr.update(), -1, gr.update()
            with page.said():
                loaded = read_upload(file)
            return loaded, -1, f"{len(loaded)} prompts loaded"

        def on_next(items, index):
            if not items:
                raise gr.Error("Load a prompt set first (JSONL or CSV).")
            index = (index + 1) % len(items)
            return items[index], index, f"prompt {index + 1} of {len(items)}"

        def on_answers(m1, m2, prompt, temp, top_p, max_new, request: gr.Request):
            yield from page.limited(request, ab_answers, page.registry, m1, m2, prompt, temp, top_p, max_new, None,
                                    page.blinded)

        prompt_file.change(on_file, prompt_file, [prompt_set, prompt_index, set_status])
        next_prompt.click(on_next, [prompt_set, prompt_index], [ab_prompt, prompt_index, set_status])
        ab_go.click(on_answers, [first, second, ab_prompt, ab_temp, ab_top_p, ab_max],
                    [answer_a, answer_b, ab_status, ab_state])
        def on_vote(vote, state):
            with page.said():
                return ab_vote(page.db, vote, state, page.blinded)

        for v, button in vote_buttons.items():
            button.click(lambda state, v=v: on_vote(v, state), ab_state, [ab_status, ab_state])
    return first, second


def _results_tab(page: _Page, results_head: list[str]) -> None:
    """The A/B results tab: the votes' win rates, and the command that trains on them."""
    gr = page.gr
    with gr.Tab("A/B results", id="results") as results_tab:
        gr.Markdown(f"Votes in `{page.db}`: the first model's win rate against the second, a tie counting half, "
                    "with its Wilson 95% interval.")
        results = gr.Dataframe(headers=results_head or None, value=results_rows(page.db), interactive=False,
                               wrap=True)
        base = next((e.model for e in page.registry.choices.values() if e.model), None)
        train = gr.Markdown(train_on_votes(page.db, base))
        refresh = gr.Button("Refresh")
        refresh.click(lambda: (results_rows(page.db), train_on_votes(page.db, base)), None, [results, train])
        results_tab.select(lambda: (results_rows(page.db), train_on_votes(page.db, base)), None, [results, train])


LOOPBACK = ("127.0.0.1", "localhost", "::1")
QUEUE_SIZE = 16  # requests waiting for a generation; more are turned away rather than queued for hours
API_PENDING = 6  # the API's generations waiting or running, from everyone (see models.Pending)
API_PER_CLIENT = 4  # one API client's (a program's parallel requests); the page's visitors have PER_CLIENT
MAX_UPLOAD = "1mb"  # a prompt set is text: a megabyte is thousands of prompts
MAX_UPLOAD_STUDIO = "200mb"  # the Train tab takes training data
FAILED_LOGIN_DELAY_S = 1.0  # a wrong password is answered after this, one at a time: guessing is slow


def parse_auth(auth: str | None) -> tuple[str, str] | None:
    if auth is None:
        return None
    user, sep, password = auth.partition(":")
    if not sep or not user or not password:
        raise TunebenchError("--auth (or TUNEBENCH_AUTH) must look like USER:PASSWORD, both non-empty")
    return user, password


def check_exposure(host: str, auth: tuple[str, str] | None, no_auth: bool) -> None:
    """A server other machines can reach needs a login, unless the user says in so many words that it does not."""
    if host not in LOOPBACK and auth is None and not no_auth:
        raise TunebenchError(f"--host {host} lets other machines in, and no --auth is set; pass --auth USER:PASS (or "
                             "set TUNEBENCH_AUTH, which keeps the password out of `ps`), or --no-auth to serve "
                             "without a login on purpose")
    if auth is not None and no_auth:
        raise TunebenchError("--auth and --no-auth contradict each other; give one")


def studio_allowed(runs_dir: str | None, asked: bool, auth: tuple[str, str] | None, no_auth: bool) -> str | None:
    """The runs directory the Train and Runs tabs get, or None. They start training, export and load models on
    this machine, so they need a login, or --no-auth said on purpose: loopback is shared by every local user
    (and a web page can reach it). A --runs-dir asked for without either is refused; the default is left off,
    said in one line."""
    if runs_dir is None or auth is not None or no_auth:
        return runs_dir
    if asked:
        raise TunebenchError("the Train and Runs tabs start training on this machine: give --auth USER:PASS (or "
                             "TUNEBENCH_AUTH), or --no-auth to open them to every local user on purpose")
    print("tunebench serve: the Train and Runs tabs are off: they start training on this machine, and there is no "
          "login; give --auth USER:PASS, or --no-auth to open them to every local user on purpose", flush=True)
    return None


def allowed_hosts(host: str, extra: list[str]) -> set[str]:
    """The Host headers a server without a login answers: its loopback names, the address it listens on, this
    machine's own names and addresses when it listens on all of them, and the operator's --allowed-host. Any
    other (a DNS-rebinding page's own name, pointed at this machine) is refused."""
    names = {"127.0.0.1", "localhost", "::1", host.strip("[]").lower(), *(h.lower() for h in extra)}
    if host in ("0.0.0.0", "::"):
        import psutil

        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        names |= {a.address.split("%")[0].lower() for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family in (socket.AF_INET, socket.AF_INET6)}
    return names


class HostAllowlist:
    """ASGI middleware: a request whose Host header is not an allowed name gets 403. Written here because
    Starlette's TrustedHostMiddleware cuts the header at its first ':', which breaks an IPv6 literal ([::1]:7860)."""

    def __init__(self, app, allowed: set[str]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").lower()
            name = host[1:host.find("]")] if host.startswith("[") else host.split(":")[0]
            if name not in self.allowed:
                await refuse(scope, send, b"this server answers only its own host names (serve --allowed-host adds one)")
                return
        await self.app(scope, receive, send)


async def refuse(scope, send, body: bytes) -> None:
    """A middleware's 403 (a websocket closed as a policy violation), `body` saying why."""
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class SameOrigin:
    """ASGI middleware: a browser's request that can change something (every method but GET, HEAD and OPTIONS, and
    a websocket) from a page of another site gets 403. Browsers send Origin with every such request, and a plain
    form POST needs no preflight, so without this any page the visitor opens could upload files to Gradio's routes
    (up to their size limit each, until the disk is full) or press the studio's buttons through the visitor's
    browser. Allowed: an Origin whose host and port are the request's own Host, or an --allowed-host name;
    programs (the openai client, curl) send no Origin and pass (the API has its key, the page its login)."""

    def __init__(self, app, allowed: set[str]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        changes = scope["type"] == "websocket" or (
            scope["type"] == "http" and scope.get("method") not in ("GET", "HEAD", "OPTIONS")
            and not scope.get("path", "").startswith("/v1/"))  # the API checks Origin itself, in its errors' form
        headers = dict(scope.get("headers") or []) if changes else {}
        origin = headers.get(b"origin")
        if origin is not None:
            where = origin.decode("latin-1").lower().split("://", 1)[-1].rstrip("/")
            name = where[1:where.find("]")] if where.startswith("[") else where.split(":")[0]
            if where != headers.get(b"host", b"").decode("latin-1").lower() and name not in self.allowed:
                await refuse(scope, send, b"a request from another site's page is refused (serve --allowed-host adds "
                                          b"a name)")
                return
        await self.app(scope, receive, send)


def login_check(credentials: tuple[str, str]):
    """Gradio's login check: the one USER:PASSWORD; a wrong one answered after FAILED_LOGIN_DELAY_S, one at a time."""
    failures = asyncio.Lock()

    async def check(user: str, password: str) -> bool:
        if user == credentials[0] and secrets.compare_digest(password.encode(), credentials[1].encode()):
            return True
        async with failures:
            await asyncio.sleep(FAILED_LOGIN_DELAY_S)
        return False
    return check


def private_uploads() -> Path:
    """Gradio's upload folder (GRADIO_TEMP_DIR) as a directory of this process's own, readable by this user
    alone, unless the operator set one: its default, /tmp/gradio, is shared by every user and server on the
    machine, so an upload (a team's data) would sit there readable, and another server's files beside it."""
    if not os.environ.get("GRADIO_TEMP_DIR"):
        folder = tempfile.mkdtemp(prefix="tunebench-gradio-")  # mode 0700
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        os.environ["GRADIO_TEMP_DIR"] = folder
    return Path(os.environ["GRADIO_TEMP_DIR"])


def f16_export(run_dir: str, allow_download: bool = False) -> Path:
    """The run's f16 GGUF in RUN_DIR/export/, written by `tunebench export` the first time a run is served through
    llama.cpp and read from there after, while it is the run's: a stamp of the weights it was made from
    (RunDir.weights_stamp) is kept beside it, and a run trained again since (`train --overwrite`) is exported
    again in its place. A file with no stamp (exported by hand) counts as the run's when it is newer than every
    weight file."""
    from tunebench.jobs import export

    path = Path(run_dir) / "export" / f"{export.model_name(Path(run_dir))}-f16.gguf"
    stamp_file = path.with_name(f".{path.name}.source.json")
    stamp = RunDir(Path(run_dir)).weights_stamp()
    if path.is_file():
        kept = read_json(stamp_file).get("weights") if stamp_file.is_file() else None
        if kept == stamp or kept is None and all(path.stat().st_mtime_ns >= t for _, t in stamp.values()):
            write_json(stamp_file, {"weights": stamp})
            return path
        print(f"{path} was exported from weights the run has since replaced (trained again): exporting it again "
              "...", flush=True)
        fresh = path.with_name(f"{path.stem}.new.gguf")
        fresh.unlink(missing_ok=True)
        export.export(run_dir, "gguf", "f16", str(fresh), allow_download)
        os.replace(fresh, path)
    else:
        print(f"exporting {run_dir} to {path} for llama.cpp (once) ...", flush=True)
        export.export(run_dir, "gguf", "f16", None, allow_download)
    write_json(stamp_file, {"weights": stamp})
    return path


@dataclass(frozen=True)
class Served:
    """What `serve` answers with: model names or directories, run directories, llama.cpp exports (`ggufs`), the
    runtime the runs answer in (llama.cpp: each run's f16 export, written once), and where PyTorch places them."""

    models: list[str] = ()
    runs: list[str] = ()
    ggufs: list[str] = ()
    runtime: str = "pytorch"
    device: str = "auto"
    precision: str = "auto"
    allow_download: bool = False


@dataclass(frozen=True)
class Door:
    """How `serve` is reached: the address, the page's login (`auth` "user:password", or `no_auth` to expose it
    without one on purpose), the API's key and the Host names a page without a login answers to."""

    host: str = "127.0.0.1"
    port: int = 7860
    auth: str | None = None
    no_auth: bool = False
    api_key: str | None = None
    allowed_host: list[str] = ()


def serve(served: Served, door: Door = Door(), *, ab_db: str = "tunebench-ab.sqlite", prompts: str | None = None,
          runs_dir: str | None = None, runs_dir_asked: bool = True, studio_models: list[str] = (),
          block: bool = True):
    """Check every input (exposure, models, port, database, prompt file), then start the app; returns it.
    The studio's Train and Runs tabs work in `runs_dir` (None: off) and may start runs from `studio_models`."""
    host, port, auth, no_auth, api_key = door.host, door.port, door.auth, door.no_auth, door.api_key
    model_specs, run_dirs, ggufs, runtime = served.models, served.runs, served.ggufs, served.runtime
    allow_download = served.allow_download

    credentials = parse_auth(auth)
    check_exposure(host, credentials, no_auth)
    if api_key is not None and len(api_key) < 8:
        raise TunebenchError("--api-key (or TUNEBENCH_API_KEY) must be 8 characters or more")
    runs_dir = studio_allowed(runs_dir, runs_dir_asked, credentials, no_auth)
    if importlib.util.find_spec("gradio") is None:
        raise TunebenchError("tunebench serve needs the web extra: pip install -e '.[web]' (./run serve installs "
                             "it on first use)")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    if runtime not in ("pytorch", "llama.cpp"):
        raise TunebenchError(f"--runtime {runtime!r}: pick pytorch or llama.cpp")
    if runtime == "llama.cpp":
        entries(model_specs, run_dirs, allow_download)  # every run checked before any is exported
        ggufs = [*ggufs, *(str(f16_export(d, allow_download)) for d in run_dirs)]
        run_dirs = []
    choices = entries(model_specs, run_dirs, allow_download, ggufs)
    offered = [str(Path(d).resolve()) for d in studio_models]
    for d in offered:
        if not (Path(d) / "config.json").is_file():
            raise TunebenchError(f"--studio-model {d} is not a model directory (no config.json); give a HF model "
                                 "directory the Train tab may start runs from")
    prompt_list = load_prompts(prompts) if prompts else None
    db = votes.open_store(ab_db)
    check_port(host, port)
    private_uploads()
    registry = Registry(choices, allow_download, served.device, served.precision)
    limit = ClientLimit(PER_CLIENT)
    studio = None
    if runs_dir is not None:

        studio = Studio(runs_dir, [*model_specs, *offered])
    app = build(registry, db, prompt_list, limit, studio)
    app.queue(default_concurrency_limit=4, max_size=QUEUE_SIZE)
    through = sum(e.gguf is not None for e in choices)
    print(f"tunebench serve: {len(choices)} model(s)"
          + (f", {through} of them exports answered by llama.cpp (the others" if through else "")
          + f" on {registry.device} in {registry.precision} ({registry.placement})" + (")" if through else "")
          + f", votes in {db}" + (f", runs in {studio.runs_dir}" if studio else "")
          + f"; http://{host}:{port}"
          + (f" (login: {credentials[0]})" if credentials else " (no login: anyone who can reach the port)"),
          flush=True)
    from starlette.middleware import Middleware

    # another site's page, through the visitor's browser: refused with a login or without
    middleware = [Middleware(SameOrigin, allowed={h.lower() for h in door.allowed_host})]
    if credentials is None:  # a login is what keeps a DNS-rebinding page out; without one, the Host header
        middleware.append(Middleware(HostAllowlist, allowed=allowed_hosts(host, list(door.allowed_host))))
    # show_error=False: a traceback's text (server paths) stays in this console; gr.Error messages still reach
    # the visitor.
    app.launch(server_name=host, server_port=port, prevent_thread_lock=True, quiet=True, share=False,
               show_error=False, auth=login_check(credentials) if credentials else None,
               max_file_size=MAX_UPLOAD_STUDIO if studio else MAX_UPLOAD,
               app_kwargs={"middleware": middleware},
               run_history=False)  # its /gradio_api/run-history/* routes have no login check (and need the hub)
    openai_api.add_routes(app.app, registry, api_key, credentials is not None, ClientLimit(API_PER_CLIENT),
                          Pending(API_PENDING), client_of)
    api = ("API key: --api-key" if api_key else "closed: the page has a login; --api-key opens it" if credentials
           else "no key: anyone who can reach the port")
    print(f"OpenAI-compatible API: http://{host}:{port}/v1 (models: {', '.join(openai_api.model_ids(registry))}; "
          f"{api})", flush=True)
    if block:
        app.block_thread()
    return app
