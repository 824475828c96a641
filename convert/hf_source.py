"""Reading a Hugging Face checkpoint lazily: config.json, safetensors shards, tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from jmoe.errors import CheckpointError, ConfigError

# A checkpoint has a tokenizer when one of these exists; the rest of TOKENIZER_FILES go along with it.
TOKENIZER_CORE_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def resolve_source(src: str | Path) -> Path:
    """A local checkpoint directory, or a hub id downloaded into the local cache (needs network)."""
    path = Path(src)
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"{src} is a file; pass the checkpoint directory that holds config.json")
    if str(src).count("/") != 1 or str(src).startswith((".", "/")):
        raise CheckpointError(f"{src} does not exist (and is not a hub id like 'org/model')")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
        return Path(snapshot_download(str(src), allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, gated model, ...
        raise CheckpointError(f"{src} is not a local directory and could not be fetched from the hub: {e}") from None


def read_config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        raise ConfigError(f"{root} has no config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return cfg


class TensorSource:
    """Name -> tensor over every safetensors shard, read one tensor (or one slice) at a time.

    Shards are memory-mapped while open; release() closes them (they reopen on the next read), so
    the pages of a layer already converted do not stay mapped into the process.
    """

    def __init__(self, root: Path):
        self.root = root
        self._handles = {}
        self._where: dict[str, Path] = {}
        self._cpu = jax.devices("cpu")[0]
        for f in self._shard_files(root):
            for name in self._open(f).keys():
                self._where[name] = f
        self.release()
        if not self._where:
            raise CheckpointError(f"{root} holds no tensors")

    def _open(self, f: Path):
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(str(f), framework="flax")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f.name} is not a readable safetensors file ({e})") from None
        return self._handles[f]

    def release(self) -> None:
        """Close every shard (unmapping it); later reads reopen what they need."""
        self._handles.clear()

    @staticmethod
    def _shard_files(root: Path) -> list[Path]:
        index = root / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index.name} is malformed: {e}") from None
            files = sorted({root / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{root} is missing shard(s) listed in {index.name}: {', '.join(missing)}")
            return files
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{root} has no *.safetensors files (only safetensors checkpoints are read)")
        return files

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        self._require(name)
        return tuple(self._open(self._where[name]).get_slice(name).get_shape())

    def get(self, name: str, expected_shape: tuple[int, ...] | None = None, index: int | None = None) -> np.ndarray:
        """The tensor (or its slice [index] along the first axis) as float32 numpy."""
        shape = self.shape(name)
        if expected_shape is not None and shape != tuple(expected_shape):
            raise CheckpointError(f"tensor {name} has shape {list(shape)}, expected {list(expected_shape)}")
        handle = self._open(self._where[name])
        try:
            with jax.default_device(self._cpu):
                value = handle.get_slice(name)[index] if index is not None else handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"tensor {name} in {self._where[name].name} cannot be read ({e})") from None
        return np.asarray(value, dtype=np.float32)

    def _require(self, name: str) -> None:
        if name not in self._where:
            raise CheckpointError(f"checkpoint has no tensor {name}")
