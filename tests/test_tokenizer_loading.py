"""The tokenizer loads as AutoTokenizer would load it, without importing AutoTokenizer (which pulls in
torch where installed): the same class and the same ids, and AutoTokenizer itself where the files
ask for custom code or name a class transformers does not have."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from jmoe.tokenizer import load_tokenizer, tokenizer_class
from tests.conftest import ROOT, TINY_HF

TEXTS = ["The quick brown fox", "def main():\n    return 42\n", "12 + 35 = 47", "  spaces  and\ttabs\n\n"]


def tokenizer_dir(tmp_path, **config_changes):
    out = tmp_path / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_HF / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("changes", [{}, {"tokenizer_class": "Qwen2Tokenizer"},
                                     {"tokenizer_class": "PreTrainedTokenizerFast"}])
def test_the_class_and_ids_are_autotokenizers(tmp_path, changes):
    path = tokenizer_dir(tmp_path, **changes)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))


@pytest.mark.parametrize("changes", [{"tokenizer_class": "NoSuchTokenizer"},
                                     {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}])
def test_unknown_classes_and_custom_code_go_to_autotokenizer(tmp_path, changes):
    import transformers

    assert tokenizer_class(tokenizer_dir(tmp_path, **changes)) is transformers.AutoTokenizer


def test_loading_a_tokenizer_does_not_import_torch():
    script = ("import sys; from jmoe.tokenizer import load_tokenizer; "
              f"assert load_tokenizer(__import__('pathlib').Path({str(TINY_HF)!r})) is not None; "
              "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_streamed_text_keeps_special_tokens_only_when_asked():
    """A harmony chat answer's markers are special tokens: its stream keeps them; every other skips them."""
    from jmoe.tokenizer import StreamDetokenizer

    tokenizer = load_tokenizer(TINY_HF)
    ids = tokenizer.encode("12 + 35") + [tokenizer.convert_tokens_to_ids("<|endoftext|>")] + tokenizer.encode(" = 47")
    texts = {}
    for special in (False, True):
        stream = StreamDetokenizer(tokenizer, special_tokens=special)
        texts[special] = "".join(stream.push(i) for i in ids)
    assert texts == {False: "12 + 35 = 47", True: "12 + 35<|endoftext|> = 47"}
