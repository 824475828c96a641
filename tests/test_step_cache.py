"""The step cache (jmoe/runtime/step_cache.py): compiled steps kept on disk, so a new process runs
its steps without tracing them, and the same tokens come out."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jmoe.runtime import step_cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    folder = tmp_path / "steps"
    monkeypatch.setenv(step_cache.ENV, str(folder))
    return folder


def _step(name="test.add_scaled"):
    def add_scaled(x, y, *, scale):
        return x * scale + y

    return step_cache.CachedStep(add_scaled, name, "no graph", static_argnames=("scale",), donate_argnames=("y",))


def _entries(folder):
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def test_a_new_step_object_runs_the_stored_executable_without_compiling(cache_dir, monkeypatch):
    x = jnp.arange(4.0)
    assert np.allclose(_step()(x, jnp.ones(4), scale=2.0), 2 * np.arange(4.0) + 1)
    assert len(_entries(cache_dir)) == 1

    fresh = _step()  # as in a new process: nothing in memory
    monkeypatch.setattr(fresh.jitted, "lower", lambda *a, **k: pytest.fail("compiled again"))
    y = jnp.ones(4)
    assert np.allclose(fresh(x, y, scale=2.0), 2 * np.arange(4.0) + 1)
    assert y.is_deleted()  # donation kept
    assert len(_entries(cache_dir)) == 1


def test_each_signature_and_static_value_has_its_own_entry(cache_dir):
    step = _step()
    step(jnp.arange(4.0), jnp.ones(4), scale=2.0)
    step(jnp.arange(8.0), jnp.ones(8), scale=2.0)  # refused by the first executable: a second one
    step(jnp.arange(4.0), jnp.ones(4), scale=3.0)
    out = step(jnp.arange(4.0), jnp.ones(4), scale=2.0)  # back to the first
    assert np.allclose(out, 2 * np.arange(4.0) + 1)
    assert len(_entries(cache_dir)) == 3


def test_host_values_are_keyed_by_shape_and_dtype_not_contents(cache_dir):
    step = _step()
    step(np.arange(4, dtype=np.float32), jnp.ones(4), scale=1.0)
    step(np.arange(4, dtype=np.float32) + 7, jnp.ones(4), scale=1.0)
    step_cache.CachedStep(step.jitted._fun, step.name, step.identity, static_argnames=("scale",))(
        np.full(4, 5, np.float32), jnp.ones(4), scale=1.0)
    assert len(_entries(cache_dir)) == 1
    with pytest.raises(TypeError):
        step_cache._leaf_signature(object())


def test_a_damaged_entry_is_compiled_again_with_a_warning(cache_dir, caplog):
    _step()(jnp.arange(4.0), jnp.ones(4), scale=2.0)
    (entry,) = _entries(cache_dir)
    (cache_dir / entry).write_bytes(b"not an executable")
    with caplog.at_level(logging.WARNING, logger="jmoe.runtime"):
        out = _step()(jnp.arange(4.0), jnp.ones(4), scale=2.0)
    assert np.allclose(out, 2 * np.arange(4.0) + 1)
    assert "unreadable" in caplog.text
    assert (cache_dir / entry).read_bytes() != b"not an executable"  # replaced by the fresh compile


def test_lower_and_trace_are_jax_jits(cache_dir):
    step = _step()
    text = step.lower(jnp.arange(4.0), jnp.ones(4), scale=2.0).as_text()
    assert "stablehlo.multiply" in text
    assert step.trace(jnp.arange(4.0), jnp.ones(4), scale=2.0).jaxpr is not None
    assert not cache_dir.exists() or not _entries(cache_dir)


def test_off_means_plain_jit(monkeypatch):
    monkeypatch.setenv(step_cache.ENV, "off")
    assert not step_cache.enabled() and step_cache.directory() is None
    from jmoe.decoding import engine

    assert not isinstance(engine.jit_for(lambda g, x: x, object()), step_cache.CachedStep)


_GENERATE = """
import json, sys
import jax.monitoring
traced = []


def listen(event, duration, fun_name=None, **_):
    if event.endswith("jaxpr_trace_duration"):
        traced.append(fun_name)


jax.monitoring.register_event_duration_secs_listener(listen)
import jmoe
model = jmoe.load(sys.argv[1], compute_dtype="float32")
greedy = jmoe.generate(model, [5, 17, 42, 99, 7], max_new_tokens=8)
sampled = jmoe.generate(model, [11, 3, 250], max_new_tokens=8, temperature=1.0, seed=3)
steps = [n for n in traced if n and ("_forward" in n or "_decode" in n)]
print(json.dumps({"greedy": greedy, "sampled": sampled, "traced_steps": steps}))
"""


def _run_generate(model_dir, env) -> dict:
    proc = subprocess.run([sys.executable, "-c", _GENERATE, str(model_dir)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_traces_no_step_and_generates_the_same_tokens(short_converted, tmp_path):
    import os

    env = dict(os.environ, JMOE_STEP_CACHE=str(tmp_path / "steps"))
    first = _run_generate(short_converted, env)
    second = _run_generate(short_converted, env)
    plain = _run_generate(short_converted, dict(env, JMOE_STEP_CACHE="off"))
    assert first["traced_steps"] and not second["traced_steps"]
    assert first["greedy"] == second["greedy"] == plain["greedy"]
    assert first["sampled"] == second["sampled"] == plain["sampled"]
