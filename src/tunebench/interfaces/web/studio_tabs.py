"""serve's Train and Runs tabs: the page over interfaces/web/studio.py (which holds the logic, tested without a
browser). Built inside app.build's Blocks, beside Chat and A/B, whose model lists they add finished runs to.

No `from __future__ import annotations`: a handler gets the visitor's request (who started a run may stop it)
through a parameter annotated gr.Request, which Gradio must be able to evaluate (see app.py).
Every value the page sends is checked by the studio's own checks (a run name, a model, a number's bounds):
a dropdown's list is only advice to a browser.
"""

import io
from pathlib import Path
from types import SimpleNamespace

from tunebench.core.errors import TunebenchError
from tunebench.interfaces.web import studio as studio_
from tunebench.interfaces.web import studio_views as views
from tunebench.interfaces.web.models import Registry, client_of, entries
from tunebench.settings.rundir import RunDir
from tunebench.settings.schema import DEFAULT_EFFECTIVE_BATCH, EXPORT_FORMATS

SETTINGS_HEAD = ["setting", "value", "reason"]
BASE = "its base"  # the Runs tab's A/B: the picked run against the model it was trained from


def _image(png: bytes | None):

    from PIL import Image

    return None if png is None else Image.open(io.BytesIO(png))


def _ask(data, name, model, method, batch, steps, epochs, max_length, processes) -> studio_.Ask:
    if not data:
        raise TunebenchError("no data yet: upload a file (CSV, JSON, JSONL or Parquet) or use the built-in sample")
    return studio_.Ask(data=data, name=(name or "").strip(), model=(model or "").strip(), method=method,
                       effective_batch=int(batch) if batch else None, max_steps=int(steps) if steps else None,
                       epochs=float(epochs) if epochs else None, max_length=int(max_length),
                       processes=1 if processes is None else int(processes))  # 0 reaches check, refused


def add_tabs(gr, studio: studio_.Studio, registry: Registry, tabs, chat_model, ab_first, ab_second, db: Path) -> None:
    """The Train and Runs tabs, inside the caller's `gr.Tabs` (`tabs`)."""
    _train_tab(gr, studio)
    _runs_tab(gr, studio, registry, [tabs, chat_model, ab_first, ab_second], db)


def error(e: Exception) -> str:
    return f"**Error:** {e}"


def act(fn, run):
    """fn(run)'s message, or its one-line error."""
    try:
        return fn(run)
    except TunebenchError as e:
        return error(e)


def _train_tab(gr, studio: studio_.Studio) -> None:
    """The Train tab: data, model and method picked, the settings shown before a start, the live view of a run."""
    with gr.Tab("Train", id="train"):
        gr.Markdown("Fine-tune from this page: pick data, see the settings the run will use and why, then watch it "
                    "train. The run is a `tunebench train` process in its own directory under "
                    f"`{studio.runs_dir}`: closing the page does not stop it.")
        data_path = gr.State("")
        with gr.Row():
            upload = gr.File(label="Training data (CSV, JSON, JSONL, Parquet)", type="filepath", height=110,
                             file_types=[".csv", ".json", ".jsonl", ".parquet"], elem_id="tb-upload")
            with gr.Column():
                sample = gr.Button("Use the built-in sample (customer support)", elem_id="tb-sample")
                max_length = gr.Number(128, label="max_length (tokens)", precision=0, minimum=8)
        data_info = gr.Markdown("", elem_id="tb-data-info")
        examples = gr.HTML("", elem_id="tb-examples")
        with gr.Row():
            offered = studio.models()
            model = gr.Dropdown(offered, value=offered[0], label="Model (a preset, a served base, a run, or a "
                                "directory the operator offers)", elem_id="tb-model")
            method = gr.Dropdown(list(studio_.METHODS), value="lora", label="Method", elem_id="tb-method")
            batch = gr.Number(0, label=f"Effective batch (0: the default, {DEFAULT_EFFECTIVE_BATCH})", precision=0, minimum=0)
            steps = gr.Number(0, label="Steps (0: by epochs)", precision=0, minimum=0, elem_id="tb-steps")
            epochs = gr.Number(0, label="Epochs (0: the default, 1)", minimum=0)
            processes = gr.Number(1, label="Processes (ranks on this machine)", precision=0, minimum=1,
                                  elem_id="tb-processes")
            name = gr.Textbox(label="Run name", placeholder="my-run", elem_id="tb-name")
        with gr.Row():
            check = gr.Button("Show the settings", elem_id="tb-check")
            start = gr.Button("Start training", variant="primary", elem_id="tb-start")
        settings = gr.Dataframe(headers=SETTINGS_HEAD, value=[], interactive=False, wrap=True, elem_id="tb-settings")
        message = gr.Markdown("", elem_id="tb-message")
        queue = gr.Markdown(studio.queue_text(), elem_id="tb-queue")
        gr.Markdown("### Live")
        with gr.Row():
            watched = gr.Dropdown(studio.names(), value=(studio.names() or [None])[0], label="Run",
                                  elem_id="tb-watched")
            state = gr.Markdown("", elem_id="tb-state")
            stop = gr.Button("Stop (checkpoint kept)", elem_id="tb-stop")
            resume = gr.Button("Resume", elem_id="tb-resume")
        with gr.Row():  # the run report's own charts (jobs/run_report.py), redrawn as the run logs
            plots = [gr.Image(label=label, show_label=False, interactive=False, height=300, elem_id=f"tb-{key}",
                              buttons=["download", "fullscreen"])
                     for key, label in (("loss", "loss"), ("speed", "tokens/s"), ("memory", "memory"),
                                        ("method", "the method's own"))]
        points = gr.Markdown("", elem_id="tb-points")
        log = gr.Textbox(label="The run's output (its settings, the measurements as they happen)", lines=12,
                         interactive=False, max_lines=12, autoscroll=True, elem_id="tb-log")
        timer = gr.Timer(2.0)
        c = SimpleNamespace(**{k: v for k, v in locals().items() if k not in ("gr", "studio")})  # its components
        _train_form_events(gr, studio, c)
        _train_live_events(gr, studio, c)


def _train_form_events(gr, studio: studio_.Studio, c: SimpleNamespace) -> None:
    """The Train tab's data, settings and start (`c`: the tab's components)."""
    # the tab's components this part reads
    batch, check, data_info, data_path = c.batch, c.check, c.data_info, c.data_path
    epochs, examples = c.epochs, c.examples
    max_length, message, method, model = c.max_length, c.message, c.method, c.model
    name, processes = c.name, c.processes
    queue, sample, settings, start, steps, upload = c.queue, c.sample, c.settings, c.start, c.steps, c.upload
    watched = c.watched

    def on_data(path, length, model_):
        try:
            shown = studio_.preview(path, studio.check_model(model_), int(length or 128))
        except TunebenchError as e:
            return "", error(e), ""
        return path, shown.markdown(), studio_.examples_html(shown)

    def on_upload(file, length, model_):
        if not file:
            return "", "", ""
        try:
            kept = studio.keep_upload(file)
        except TunebenchError as e:
            return "", error(e), ""
        return on_data(kept, length, model_)

    upload.upload(on_upload, [upload, max_length, model], [data_path, data_info, examples])
    sample.click(lambda length, m: on_data(studio_.SAMPLE, length, m), [max_length, model],
                 [data_path, data_info, examples])
    asked = [data_path, name, model, method, batch, steps, epochs, max_length, processes]

    def on_check(*values):
        try:
            a = _ask(*values)
            studio.check_model(a.model)
            return studio_.settings_rows(a, studio_.check(a, studio.runs_dir)), "The run will use these settings."
        except TunebenchError as e:
            return [], error(e)

    def on_start(data_, name_, model_, method_, batch_, steps_, epochs_, length_, processes_,
                 request: gr.Request):
        try:
            a = _ask(data_, name_, model_, method_, batch_, steps_, epochs_, length_, processes_)
            studio.check_model(a.model)
            rows = studio_.settings_rows(a, studio_.check(a, studio.runs_dir))
            said = studio.start(a, client_of(request))
        except TunebenchError as e:
            return gr.update(), error(e), gr.update(), studio.queue_text()
        return rows, said, gr.Dropdown(choices=studio.names(), value=a.name), studio.queue_text()

    check.click(on_check, asked, [settings, message])
    start.click(on_start, asked, [settings, message, watched, queue])


def _train_live_events(gr, studio: studio_.Studio, c: SimpleNamespace) -> None:
    """The Train tab's live view: the watched run's state, charts and output every two seconds; stop and resume."""
    # the tab's components this part reads
    log, message, plots, points, queue, resume = c.log, c.message, c.plots, c.points, c.queue, c.resume
    state, stop, timer, watched = c.state, c.stop, c.timer, c.watched

    charts = views.Charts()  # shared by every page
    shown = gr.State(None)  # what this page shows: (run, the key of its drawing)

    def on_tick(run, showing):
        if not run:
            return studio.queue_text(), "", *[None] * len(plots), "", "", None
        try:
            run = studio_.run_name(run)
            state_ = studio.state(run)
        except TunebenchError as e:
            return studio.queue_text(), error(e), *[None] * len(plots), "", "", None
        run_dir = studio.runs_dir / run
        key, drawn = charts.get(run_dir, training=state_.startswith(("running", "stopping")))
        if showing == (run, key):  # nothing new: the page keeps its pictures
            images = [gr.skip()] * len(plots)
        else:
            images = [gr.update(value=_image(png), label=caption, visible=png is not None)
                      for caption, png in drawn]
        loss = views.loss_points(run_dir)
        return (studio.queue_text(), f"**{run}**: {state_}", *images,
                f"{sum(r['series'] == 'train loss' for r in loss)} train-loss points, "
                f"{sum(r['series'] == 'eval loss' for r in loss)} eval-loss points", studio.log_tail(run),
                (run, key))

    live = [queue, state, *plots, points, log, shown]
    timer.tick(on_tick, [watched, shown], live)
    watched.change(on_tick, [watched, shown], live)

    def act(fn, run):
        try:
            return fn(run)
        except TunebenchError as e:
            return error(e)

    def on_stop(run, request: gr.Request):
        return act(lambda r: studio.stop(r, client_of(request)), run)

    def on_resume(run, request: gr.Request):
        return act(lambda r: studio.resume(r, client_of(request)), run)

    stop.click(on_stop, watched, message)
    resume.click(on_resume, watched, message)


def _runs_tab(gr, studio: studio_.Studio, registry: Registry, switch_to: list, db: Path) -> None:
    """The Runs tab: every run, its report, chat or A/B with it, export it, DPO from its votes. `switch_to`: the
    page's tabs and the Chat and A/B model pickers a run is sent to."""
    with gr.Tab("Runs", id="runs") as runs_tab:
        gr.Markdown(f"Every run under `{studio.runs_dir}`, those started from the command line too.")
        table = gr.Dataframe(headers=views.RUN_COLUMNS, value=views.runs_table(studio), interactive=False,
                             wrap=True, elem_id="tb-runs")
        with gr.Row():
            picked = gr.Dropdown(studio.names(), value=None, label="Run", elem_id="tb-picked")  # none picked yet
            refresh = gr.Button("Refresh", elem_id="tb-refresh")
        with gr.Row():
            chat_it = gr.Button("Chat with it", elem_id="tb-chat")
            versus = gr.Dropdown([BASE, *studio.names()], value=BASE, label="A/B against", elem_id="tb-versus")
            ab_it = gr.Button("A/B it", elem_id="tb-ab")
            dpo = gr.Button("DPO from the A/B votes", elem_id="tb-dpo")
        with gr.Row():
            fmt = gr.Dropdown(list(EXPORT_FORMATS), value="gguf", label="Export format")
            quant = gr.Dropdown(list(studio_.QUANTS), value="q8_0", label="Quantization")
            export = gr.Button("Export", elem_id="tb-export")
        runs_message = gr.Markdown("", elem_id="tb-runs-message")
        report = gr.HTML("", elem_id="tb-report")
        c = SimpleNamespace(**{k: v for k, v in locals().items()
                               if k not in ("gr", "studio", "registry", "switch_to", "db")})
        _runs_list_events(gr, studio, c)
        _runs_serving_events(gr, studio, registry, c, switch_to)
        _runs_export_events(gr, studio, registry, c, switch_to, db)


def _runs_list_events(gr, studio: studio_.Studio, c: SimpleNamespace) -> None:
    """The Runs tab's table and the picked run's report."""
    # the tab's components this part reads
    picked, refresh, report, runs_tab, table, versus = c.picked, c.refresh, c.report, c.runs_tab, c.table, c.versus

    def listing():
        names = studio.names()
        return views.runs_table(studio), gr.Dropdown(choices=names), gr.Dropdown(choices=[BASE, *names])

    refresh.click(listing, None, [table, picked, versus])
    runs_tab.select(listing, None, [table, picked, versus])

    def on_pick(run):
        return views.report_or_error(studio, run) if run else ""

    picked.change(on_pick, picked, report)


def _runs_serving_events(gr, studio: studio_.Studio, registry: Registry, c: SimpleNamespace, switch_to: list) -> None:
    """Chat with the picked run, or A/B it against its base or another run: the page switches tab, the run served."""
    tabs, chat_model, ab_first, ab_second = switch_to
    # the tab's components this part reads
    ab_it, chat_it, picked, runs_message, versus = c.ab_it, c.chat_it, c.picked, c.runs_message, c.versus

    def served(run) -> tuple[str, str]:
        """(the run's label, its base's) in the served models, added when missing."""
        run_dir = str(studio.run_path(run))
        if studio.state(run) != "finished":
            raise TunebenchError(f"run {run!r} is {studio.state(run)}; chat with or compare a finished run")
        label = registry.add(entries([], [run_dir])[0])
        return label, registry.add(entries([RunDir(run_dir).base_model()], [])[0])

    def on_chat(run):
        try:
            label, _ = served(run)
        except TunebenchError as e:
            return gr.update(), gr.update(), gr.update(), gr.update(), error(e)
        keep = gr.Dropdown(choices=registry.labels)
        return gr.Tabs(selected="chat"), gr.Dropdown(choices=registry.labels, value=label), keep, keep, ""

    def on_ab(run, against):
        try:
            label, base = served(run)
            if against != BASE:
                if against == run:
                    raise TunebenchError("pick another run (or its base) to compare it against")
                base = served(against)[0]
        except TunebenchError as e:
            return gr.update(), gr.update(), gr.update(), gr.update(), error(e)
        return (gr.Tabs(selected="ab"), gr.Dropdown(choices=registry.labels),
                gr.Dropdown(choices=registry.labels, value=base), gr.Dropdown(choices=registry.labels, value=label),
                "")

    switch = [tabs, chat_model, ab_first, ab_second, runs_message]
    chat_it.click(on_chat, picked, switch)
    ab_it.click(on_ab, [picked, versus], switch)


def _runs_export_events(gr, studio: studio_.Studio, registry: Registry, c: SimpleNamespace, switch_to: list,
                        db: Path) -> None:
    """Export the picked run (a GGUF one joins the Chat and A/B lists), and DPO from its A/B votes."""
    _, chat_model, ab_first, ab_second = switch_to
    # the tab's components this part reads
    dpo, export, fmt, picked, quant, runs_message = c.dpo, c.export, c.fmt, c.picked, c.quant, c.runs_message

    def on_export(run, fmt_, quant_):
        """The export, and a GGUF one joins the Chat and A/B lists answered by llama.cpp (the file that ships,
        against the run in PyTorch or another of its exports)."""
        try:
            written = Path(views.export(studio, run, fmt_, quant_))
        except TunebenchError as e:
            return error(e), gr.update(), gr.update(), gr.update()
        said = f"Exported {run} ({fmt_}, {quant_}): `{written}`"
        label = views.offer_export(registry, written)
        if label is not None:
            said += f"; chat with it or A/B it as `{label}`"
        keep = gr.Dropdown(choices=registry.labels)
        return said, keep, keep, keep

    # one export at a time, the others queued by Gradio: each loads a model and writes files of its size
    export.click(on_export, [picked, fmt, quant], [runs_message, chat_model, ab_first, ab_second],
                 concurrency_limit=1, concurrency_id="export")
    def on_dpo(run, request: gr.Request):
        return act(lambda r: views.dpo_from_votes(studio, r, db, client_of(request)), run)

    dpo.click(on_dpo, picked, runs_message)
