import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ../shared/data beside the checkout; TUNEBENCH_SHARED_DATA points elsewhere (a GPU machine's carried copy).
SHARED = Path(os.environ.get("TUNEBENCH_SHARED_DATA") or Path(__file__).resolve().parents[1].parent / "shared" / "data")
BITEXT = SHARED / "bitext-early-official-4514rows" / "Bitext_Sample_Customer_Support_Training_Dataset.csv"

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
    """Keep tests' converted models and tokenized data out of the user's cache."""
    os.environ["TUNEBENCH_CACHE"] = str(tmp_path_factory.mktemp("tbcache"))


@pytest.fixture
def dataset(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture
def tiny():
    from tunebench import models

    return models.resolve("tiny")


def tiny_run_config(data, out, **extra):
    """A fine-tuning config for the tiny model on `data`: 6 steps of micro 2 x accumulation 2, 20% held out."""
    from tunebench.config import load_config

    options = {"model.name": "tiny", "data.path": str(data), "data.max_length": 256, "train.output_dir": str(out),
               "train.micro_batch_size": 2, "train.effective_batch_size": 4, "train.max_steps": 6,
               "train.progress": False, "train.lr": 1e-2, "data.eval_fraction": 0.2}
    options.update(extra)
    return load_config(options=options)


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

    if not all(found()) and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"], capture_output=True,
                       timeout=900)
    browser, driver = found()
    if not (browser and driver):
        pytest.skip("headless Chromium could not be installed (apt-get install chromium chromium-driver)")
    return browser, driver
