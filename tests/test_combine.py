"""Combining LoRA adapters with PEFT's add_weighted_adapter: the same adapter PEFT makes, loadable by every job."""

import pytest
import torch
from safetensors.torch import load_file

from tunebench.interfaces import cli
from tunebench.jobs import finetune, generate, merge
from tunebench.model import inference
from tunebench.settings.finetune import load_config


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    import json

    root = tmp_path_factory.mktemp("combine")
    rows = [{"instruction": f"q{i}", "response": f"answer {i}"} for i in range(16)]
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, seed, lr in (("a", 1, 1e-2), ("b", 2, 3e-2)):
        finetune.run(load_config(options={
            "model.name": "tiny", "data.path": str(root / "d.jsonl"), "train.max_steps": 2, "train.seed": seed,
            "train.lr": lr, "train.micro_batch_size": 4, "train.output_dir": str(root / name),
            "train.progress": False, "data.template": "Q: {instruction}\nA: "}))
    return root


@pytest.mark.parametrize("combination,density", [("linear", None), ("cat", None), ("ties", 0.5)])
def test_a_combination_equals_pefts_own_on_the_same_weights(two, tmp_path, combination, density):
    out = merge.combine([str(two / "a"), str(two / "b")], str(tmp_path / "ab"), [0.6, 0.4], combination, density)
    ours = load_file(out / "adapter_model.safetensors")

    reference = inference.load_for_inference(None, str(two / "a"), None).model  # PEFT by hand
    reference.load_adapter(str(two / "b"), adapter_name="b")
    extra = {"density": density} if density else {}
    reference.add_weighted_adapter(["default", "b"], [0.6, 0.4], "mix", combination_type=combination, **extra)
    reference.set_adapter("mix")
    reference.eval()  # the new adapter's modules start in training mode (LoRA dropout on)
    theirs = {k.replace(".mix.", "."): v for k, v in reference.state_dict().items() if ".mix." in k}
    assert len(ours) == len(theirs) > 0
    for key, value in ours.items():
        torch.testing.assert_close(value, theirs[key])

    loaded = inference.load_for_inference(None, str(out))  # every job loads it as a run
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(ids).logits, reference(ids).logits)
    assert generate.trained_template(str(out)) == "Q: {instruction}\nA: "


def test_the_cli_combines_and_refuses_what_peft_would(two, tmp_path, capsys):
    a, b = str(two / "a"), str(two / "b")
    assert cli.main(["merge", "--adapter", a, "--adapter", b, "--weights", "0.6,0.4", "--output-dir",
                     str(tmp_path / "ok")]) == 0
    assert "combined 2 adapters (linear, weights 0.6, 0.4)" in capsys.readouterr().out
    data = str(two / "d.jsonl")
    assert cli.main(["merge", "--adapter", a, "--adapter", b, "--output-dir", str(tmp_path / "ev"),
                     "--eval-data", data, "--eval-data", data, "--eval-rows", "2"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[-3].split() == ["task", "(data)", "metric", "its", "adapter", "combined"]
    assert [line.split()[:2] for line in table[-2:]] == [["d.jsonl", "rougeL"]] * 2
    assert cli.main(["merge", "--adapter", a, "--adapter", b, "--output-dir", str(tmp_path / "no"),
                     "--eval-data", data]) == 2
    assert "--eval-data gives 1 dataset(s) for 2 adapters" in capsys.readouterr().err
    cases = [
        (["--weights", "1"], "gives 1 weight(s) for 2 adapters"),
        (["--weights", "0.5,x"], "comma-separated numbers"),
        (["--combination", "ties"], "pass --density between 0 and 1"),
        (["--combination", "svd-magic"], "not one of linear, cat, ties, dare_ties, magnitude_prune"),
    ]
    for extra, message in cases:
        assert cli.main(["merge", "--adapter", a, "--adapter", b, "--output-dir", str(tmp_path / "no"), *extra]) == 2
        assert message in capsys.readouterr().err
    assert cli.main(["merge", "--adapter", a, "--adapter", b, "--output-dir", str(tmp_path / "ok")]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()
