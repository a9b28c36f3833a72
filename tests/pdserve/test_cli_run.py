"""``pdserve run`` end to end: a real subprocess, a real tiny model, output checked against stock generate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli import REPO, pdserve
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("qwen2")


def test_json_output_equals_stock_generate(model_dir, hf_reference, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = ["The class statement", "def f(x):\n    return x", "Hello  world", "a"]
    lines = [{"prompt": p} for p in prompts] + [{"prompt_ids": [5, 6, 7, 8], "max_tokens": 3}]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    proc = pdserve("run", "--model", model_dir, "--prompts-file", str(f), "--max-tokens", "12", "--ignore-eos",
                   "--json")
    out = proc.stdout.splitlines()
    assert len(out) == 5
    reference = hf_reference(model_dir)
    for line, item in zip(out, lines):
        assert ", " not in line and ": " not in line  # compact JSON
        obj = json.loads(line)
        assert set(obj) >= {"prompt", "token_ids", "text", "finish_reason"}
        ids = item.get("prompt_ids") or tok(item["prompt"])["input_ids"]
        n = item.get("max_tokens", 12)
        assert obj["token_ids"] == hf_greedy(reference, ids, n)
        assert obj["text"] == tok.decode(obj["token_ids"], skip_special_tokens=True)
        assert obj["finish_reason"] == "length"
    assert json.loads(out[0])["prompt"] == prompts[0]
    assert json.loads(out[4])["prompt_token_ids"] == [5, 6, 7, 8]


def test_eos_is_in_token_ids_but_not_in_text(model_dir, hf_reference, tmp_path):
    """Greedy run without --ignore-eos: stops exactly where stock generate stops (EOS included)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = pdserve("run", "--model", model_dir, "--prompt", "</s></s>", "--max-tokens", "40", "--json")
    obj = json.loads(proc.stdout)
    ids = tok("</s></s>")["input_ids"]
    expected = hf_greedy(hf_reference(model_dir), ids, 40, eos_token_id=tok.eos_token_id)
    assert obj["token_ids"] == expected
    if expected[-1] == tok.eos_token_id:
        assert obj["finish_reason"] == "stop" and "</s>" not in obj["text"]


def test_plain_output_prints_the_text(model_dir):
    proc = pdserve("run", "--model", model_dir, "--prompt", "The class statement", "--max-tokens", "8",
                   "--ignore-eos")
    js = pdserve("run", "--model", model_dir, "--prompt", "The class statement", "--max-tokens", "8",
                 "--ignore-eos", "--json")
    assert proc.stdout == json.loads(js.stdout)["text"] + "\n"


def test_seeded_sampling_is_reproducible_across_runs(model_dir):
    args = ("run", "--model", model_dir, "--prompt", "x = 1", "--max-tokens", "16", "--ignore-eos",
            "--temperature", "0.9", "--top-p", "0.9", "--top-k", "50", "--seed", "42", "--json")
    first, second = pdserve(*args), pdserve(*args)
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "-1"], "-1"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_new_tokens"),
    ],
)
def test_bad_sampling_values_exit_2_naming_them(model_dir, extra, message):
    proc = pdserve("run", "--model", model_dir, "--prompt", "hi", *extra, check=False)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_bad_inputs_exit_2_with_a_clear_error(model_dir, tmp_path):
    missing = pdserve("run", "--model", str(tmp_path / "nope"), "--prompt", "hi", check=False)
    assert missing.returncode == 2 and "nope" in missing.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    proc = pdserve("run", "--model", model_dir, "--prompts-file", str(bad), check=False)
    assert proc.returncode == 2 and "bad.jsonl:2" in proc.stderr
    empty = pdserve("run", "--model", model_dir, "--prompt", "", check=False)
    assert empty.returncode == 2 and "prompt is empty" in empty.stderr


def test_pickle_weights_need_the_flag_and_then_give_the_same_output(model_dir, tmp_path):
    from tests.pickle_checkpoint import pickle_copy

    pickled = str(pickle_copy(model_dir, tmp_path / "pickled"))
    args = ("--prompt", "The class statement", "--max-tokens", "8", "--ignore-eos", "--json")
    refused = pdserve("run", "--model", pickled, *args, check=False)
    assert refused.returncode == 2 and refused.stdout == ""
    assert "['pytorch_model.bin']" in refused.stderr and "--allow-pickle-weights" in refused.stderr
    allowed = pdserve("run", "--model", pickled, "--allow-pickle-weights", *args)
    safe = pdserve("run", "--model", model_dir, *args)
    assert json.loads(allowed.stdout)["token_ids"] == json.loads(safe.stdout)["token_ids"]


def test_cli_help_does_not_import_torch():
    code = "import sys, pdserve.cli as c; c.build_parser(); assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
