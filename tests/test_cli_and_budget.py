"""The jmoe command line and device-budget handling."""

from __future__ import annotations

import json
import threading

import pytest

import jmoe
from jmoe.cli import main
from jmoe.errors import BudgetError, InputError
from jmoe.runtime.budget import parse_size


def test_cli_convert_generate_info(tiny_hf_dir, tmp_path, capsys):
    out = tmp_path / "tiny"
    assert main(["convert", str(tiny_hf_dir), "-o", str(out), "--no-progress"]) == 0
    assert main(["generate", str(out), "def fibonacci(n):", "--max-new-tokens", "12", "--device-budget", "256MiB"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def fibonacci(n):") and len(text) > len("def fibonacci(n):\n")
    assert main(["info", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["tiers"]["bf16"]["total_expert_bytes"] == 8 * 32 * info["tiers"]["bf16"]["bytes_per_expert"]


def test_cli_generate_takes_presence_and_frequency_penalties(short_converted, short_model, capsys):
    prompt = "def main():\n    "
    kw = dict(max_new_tokens=12, presence_penalty=0.5, frequency_penalty=1.5)
    expected = jmoe.generate(short_model, prompt, **kw)
    assert expected != jmoe.generate(short_model, prompt, max_new_tokens=12)
    capsys.readouterr()
    assert main(["generate", str(short_converted), prompt, "--max-new-tokens", "12", "--dtype", "float32",
                 "--presence-penalty", "0.5", "--frequency-penalty", "1.5"]) == 0
    assert capsys.readouterr().out == prompt + expected + "\n"


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert main(["generate", str(tmp_path / "missing"), "hi"]) == 2
    assert "jmoe: error:" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing"), "-o", str(tmp_path / "o")]) == 2


@pytest.mark.parametrize("text,expected", [("12GiB", 12 * 2**30), ("512 MiB", 512 * 2**20), ("2.5GB", 2_500_000_000),
                                           (4096, 4096), ("100", 100)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "12 parsecs", "-3GiB", 0, "GiB"])
def test_parse_size_rejects_garbage(bad):
    with pytest.raises(InputError):
        parse_size(bad)


def test_budget_too_small_names_the_minimum(tiny_converted):
    with pytest.raises(BudgetError, match=r"needs [0-9.]+ MiB before any expert \(dense .*kv_cache .*workspace"):
        jmoe.load(tiny_converted, device_budget="4MiB")
    # the tokenizer, loading in a thread of its own, is waited for: nothing of the failed load runs on
    assert not any(t.name == "jmoe-tokenizer" for t in threading.enumerate())
    with pytest.raises(BudgetError, match=r"too small for policy 'resident'.*needs at least [0-9.]+ MiB"):
        jmoe.load(tiny_converted, device_budget="32MiB", policy="resident")
    assert jmoe.load(tiny_converted, device_budget="32MiB").policy.name == "lru+prefetch"  # offloads by default
    model = jmoe.load(tiny_converted, device_budget="256MiB", compute_dtype="float32")
    assert model.policy.name == "resident" and sum(model.memory.values()) <= 256 * 2**20
    with pytest.raises(BudgetError, match="KV cache"):
        jmoe.generate(model, ["a", "b", "c"], max_new_tokens=2000)


def test_sigusr1_prints_a_jmoe_commands_stacks_and_it_goes_on():
    """`kill -USR1` on a jmoe command (one that seems stuck) prints where each thread is, and does not end it."""
    import subprocess
    import sys

    code = ("import os, signal; from jmoe.cli import main; main(['info', '--help']); "
            "os.kill(os.getpid(), signal.SIGUSR1); print('still here')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("still here"), done.stderr[-2000:]
    assert "most recent call first" in done.stderr and "in <module>" in done.stderr, done.stderr[-2000:]


def test_loading_pauses_the_garbage_collector_and_only_the_commands_own_process_freezes(short_converted, capsys):
    """jmoe.load and main() called in-process leave the collector as they found it (on, nothing frozen);
    the `jmoe` command's own process freezes what start-up loaded (jmoe/runtime/collector.py)."""
    import gc
    import subprocess
    import sys

    frozen = gc.get_freeze_count()
    assert gc.isenabled()
    assert main(["generate", str(short_converted), "def f", "--max-new-tokens", "2"]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == frozen
    gc.disable()
    try:
        jmoe.load(short_converted)
        assert not gc.isenabled()  # a caller's choice to keep it off stands
    finally:
        gc.enable()
    code = ("import gc, sys; from jmoe import cli; sys.argv[1:] = ['generate', sys.argv[1], 'def f', "
            "'--max-new-tokens', '2']\ntry:\n    cli.entry()\nexcept SystemExit as e:\n"
            "    print(e.code, gc.isenabled(), gc.get_freeze_count() > 0)")
    done = subprocess.run([sys.executable, "-c", code, str(short_converted)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "0 True True", done.stdout[-2000:]
