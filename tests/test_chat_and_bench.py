"""`jmoe chat` (the terminal chat over the batching engine) and `jmoe bench` (pp / tg tokens per second)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import jmoe
from jmoe.cli import main
from jmoe.decoding.sampling import SamplingOptions
from jmoe.serving import BatchEngine
from jmoe.serving.chat import chat_loop, chat_prompt


def test_chat_answers_each_turn_with_the_history_and_forgets_on_reset(short_converted):
    turns = "Hello\n/help\n/reset\nWhat is 12 + 35?\n/quit\n"
    done = subprocess.run([sys.executable, "-m", "jmoe.cli", "chat", str(short_converted), "--max-tokens", "8",
                           "--dtype", "float32", "--max-seq-len", "256"], input=turns, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "(conversation forgotten)" in out and out.count("> ") >= 5
    assert out.count("/reset forgets the conversation") == 2  # the banner, and /help's answer (not the model's)
    model = jmoe.load(short_converted, compute_dtype="float32")
    first = jmoe.generate(model, chat_prompt(model, [{"role": "user", "content": "Hello"}]), max_new_tokens=8)
    assert model.tokenizer.decode(first) in out  # the first answer is the model's greedy answer to that turn


class InterruptingOutput(io.StringIO):
    """A terminal where Ctrl-C arrives while the first answer streams."""

    def __init__(self):
        super().__init__()
        self.interrupted = False
        self.answering = False

    def write(self, text: str) -> int:
        if self.answering and text and not self.interrupted and text not in ("\n",):
            self.interrupted = True
            raise KeyboardInterrupt
        if text == "> ":
            self.answering = False
        return super().write(text)


def test_ctrl_c_stops_the_answer_not_the_chat(short_model):
    stdin = io.StringIO("Tell me a story\nHello\n")
    out = InterruptingOutput()

    class Reader:
        def readline(self):
            out.answering = True  # what follows a read line is the answer
            return stdin.readline()

    with BatchEngine(short_model, max_batch=1, context=256) as engine:
        chat_loop(engine, max_tokens=32, sampling=SamplingOptions(), stdin=Reader(), stdout=out)
        assert engine.running == 0  # the stopped answer freed its row
    text = out.getvalue()
    assert out.interrupted and "[stopped]" in text
    assert text.count("> ") == 3  # it went on to the next turn and then to the end of input


def test_bench_reports_pp_and_tg_rows_with_offload_figures(tiny_converted, capsys):
    code = main(["bench", str(tiny_converted), "-p", "16", "-n", "4", "-b", "1,2", "-r", "1", "--json",
                 "--device-budget", "14MiB", "--max-seq-len", "128", "--dtype", "float32"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["test"], r["batch"]) for r in rows] == [("pp16", 1), ("tg4", 1), ("tg4", 2)]
    assert all(r["tokens_per_s"] > 0 and 0 <= r["hit_rate"] <= 1 and r["bytes_h2d_per_token"] >= 0 for r in rows)
    # decode rows count the decode steps' own tokens (EOS banned: every row decodes all of them)
    assert [r["tokens_per_run"] for r in rows] == [16, 3, 6]
    assert main(["bench", str(tiny_converted), "-p", "16", "-n", "4", "-r", "1", "--dtype", "float32"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| model | backend | test |") and "| pp16 | 1 |" in table and "| tg4 | 1 |" in table


def test_bench_refuses_bad_lengths(tiny_converted, capsys):
    assert main(["bench", str(tiny_converted), "-p", "abc"]) == 2
    assert "--prompt-lengths" in capsys.readouterr().err
    assert main(["bench", str(tiny_converted), "-n", "1", "-r", "1"]) == 2
    assert "generation length" in capsys.readouterr().err


def test_a_compile_in_a_timed_window_fails_the_bench(short_converted, monkeypatch, capsys):
    """`jmoe bench` and the benchmarks' timing helper time only warmed shapes: a call that compiles
    something new each time (here a product of a new length per call) fails the run, named, rather
    than slowing its figure; the same call without the new compile passes."""
    import jax
    import jax.numpy as jnp
    import pytest

    from bench.lib.common import timed
    from jmoe.serving.compiles import CompiledInTimedWindow, no_compiles

    calls = []

    def compiling():
        calls.append(None)
        jax.jit(lambda v: v * 2)(jnp.zeros(len(calls))).block_until_ready()

    with pytest.raises(CompiledInTimedWindow, match="timed window of compiling"):
        timed(compiling, repeat=2)
    same = jax.jit(lambda v: v + 1)
    assert timed(lambda: same(jnp.zeros(3)).block_until_ready(), repeat=2) > 0
    with no_compiles("nothing new"):
        same(jnp.zeros(3)).block_until_ready()

    generate = jmoe.generate

    def generate_and_compile(*args, **kwargs):
        compiling()
        return generate(*args, **kwargs)

    monkeypatch.setattr(jmoe, "generate", generate_and_compile)
    code = main(["bench", str(short_converted), "-p", "16", "-n", "4", "-r", "1", "--dtype", "float32",
                 "--max-seq-len", "128"])
    assert code == 2
    assert "compilation(s) in the timed window of pp16: warm every shape" in capsys.readouterr().err
