"""The tokenizer gives what AutoTokenizer would give, without importing AutoTokenizer (which pulls in
torch where installed): a tokenizer.json that transformers would only wrap is read by the `tokenizers`
library alone (jmoe.tokenizer.TokenizerFile: the same ids, text and special tokens, transformers not
imported until a chat template is rendered); any other loads as the class AutoTokenizer would choose,
and AutoTokenizer itself where the files ask for custom code or name a class transformers does not have."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from jmoe.tokenizer import TokenizerFile, load_tokenizer, tokenizer_class
from tests.conftest import DATA, ROOT, TINY_HF

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


def corpus_lines() -> list[str]:
    text = "".join((DATA / f"{d}.train.txt").read_text()[:6000] for d in ("prose", "code", "math"))
    return [line for line in text.splitlines() if line] + TEXTS


@pytest.mark.parametrize("changes", [{}, {"tokenizer_class": "PreTrainedTokenizerFast"}])
def test_a_plain_tokenizer_json_gives_autotokenizers_ids_text_and_special_tokens(tmp_path, changes):
    path = tokenizer_dir(tmp_path, **changes)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert isinstance(ours, TokenizerFile)
    for text in corpus_lines():
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == auto.encode(text, add_special_tokens=special)
    draw = random.Random(0)
    for _ in range(200):  # any ids, special ones included, skipped or kept
        ids = [draw.randrange(len(auto)) for _ in range(draw.randrange(1, 24))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    for name in ("bos_token", "eos_token", "pad_token", "eos_token_id", "added_tokens_encoder", "chat_template"):
        assert getattr(ours, name) == getattr(auto, name), name
    assert ours.convert_tokens_to_ids("<|endoftext|>") == auto.convert_tokens_to_ids("<|endoftext|>")


@pytest.mark.parametrize("changes", [{"tokenizer_class": "Qwen2Tokenizer"}, {"add_bos_token": True},
                                     {"clean_up_tokenization_spaces": True}, {"bos_token": "<|not-in-vocab|>"},
                                     {"eos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "lstrip": True,
                                                    "rstrip": False, "normalized": False, "special": True}}])
def test_files_transformers_would_change_load_as_autotokenizer_loads_them(tmp_path, changes):
    path = tokenizer_dir(tmp_path, **changes)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
        assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text))


def test_a_chat_template_renders_as_autotokenizer_renders_it(tmp_path):
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = tokenizer_dir(tmp_path, chat_template=template)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    assert isinstance(ours, TokenizerFile) and ours.chat_template == auto.chat_template == template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12 + 35 ="}]
    assert (ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            == auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


@pytest.mark.parametrize("changes", [{"tokenizer_class": "NoSuchTokenizer"},
                                     {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}])
def test_unknown_classes_and_custom_code_go_to_autotokenizer(tmp_path, changes):
    import transformers

    assert tokenizer_class(tokenizer_dir(tmp_path, **changes)) is transformers.AutoTokenizer


def test_loading_and_using_a_plain_tokenizer_imports_neither_transformers_nor_torch():
    script = ("import sys; from jmoe.tokenizer import decode, encode, load_tokenizer; "
              f"t = load_tokenizer(__import__('pathlib').Path({str(TINY_HF)!r})); "
              "assert decode(t, encode(t, 'def f(x):', 4096)) == 'def f(x):'; "
              "print('transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False False"


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
