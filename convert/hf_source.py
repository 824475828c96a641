"""Reading a Hugging Face checkpoint lazily: config.json, safetensors shards, tokenizer files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from jmoe import validate
from jmoe.errors import CheckpointError, ConfigError
from jmoe.tokenizer import first_line

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


def resolve_source(src: Path) -> Path:
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
        raise CheckpointError(f"{src} is not a local directory and could not be fetched from the hub: "
                              f"{first_line(e)}") from None


def read_config(root: Path) -> dict[str, Any]:
    path = root / "config.json"
    if not path.is_file():
        raise ConfigError(f"{root} has no config.json")
    return validate.read_json_object(path, what="config.json", error=ConfigError)


def trusted_root(root: Path) -> Path:
    """The directory files copied from a checkpoint must resolve into: the checkpoint itself, or for
    a Hugging Face cache snapshot (whose files link into the repository's blobs/) that repository."""
    root = root.resolve()
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return root.parent.parent
    return root


# safetensors dtypes that hold weights; anything else (I64, BOOL, U8, ...) is refused by name.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


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
                if name in self._where:
                    raise CheckpointError(f"tensor {name} is stored twice, in {self._where[name].name} and {f.name}")
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
            weight_map = validate.read_json_object(index, what="safetensors index", error=CheckpointError).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index.name} has no 'weight_map' of tensor names to shard files")
            for name in set(weight_map.values()):
                if Path(name).name != name or name in ("", ".", ".."):
                    raise CheckpointError(f"{index.name} names shard {name!r}, which is not a file in {root}")
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

    def _read(self, name: str, expected_shape: tuple[int, ...] | None, index: int | slice | None,
              dtypes: tuple[str, ...], requirement: str):
        """The raw tensor (or its slice [index] along the first axis: one entry or a range of rows),
        after checking its shape and that its dtype is one of `dtypes` (`requirement` says so in the error)."""
        shape = self.shape(name)
        if expected_shape is not None and shape != tuple(expected_shape):
            raise CheckpointError(f"tensor {name} has shape {list(shape)}, expected {list(expected_shape)}")
        handle = self._open(self._where[name])
        try:
            dtype = handle.get_slice(name).get_dtype()
            if dtype not in dtypes:
                raise CheckpointError(f"tensor {name} has dtype {dtype}; {requirement}")
            with jax.default_device(self._cpu):
                return handle.get_slice(name)[index] if index is not None else handle.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"tensor {name} in {self._where[name].name} cannot be read ({e})") from None

    def get(self, name: str, expected_shape: tuple[int, ...] | None = None, index: int | slice | None = None
            ) -> np.ndarray:
        """The tensor (or its slice [index] along the first axis: an expert, or a range of rows read
        without the rest) as float32 numpy; refuses shapes other than `expected_shape`, non-float
        dtypes and NaN/Inf values, naming the tensor."""
        value = np.asarray(self._read(name, expected_shape, index, FLOAT_DTYPES,
                                      f"weights must be one of {', '.join(FLOAT_DTYPES)}"), dtype=np.float32)
        if not np.isfinite(value).all():
            bad = int(value.size - np.isfinite(value).sum())
            where = ""
            if isinstance(index, slice):
                where = f" (rows {index.start}-{index.stop - 1})"
            elif index is not None:
                where = f" (expert {index})"
            raise CheckpointError(f"tensor {name}{where} holds {bad} NaN or infinite value(s)")
        return value

    def get_bytes(self, name: str, expected_shape: tuple[int, ...], index: int | None = None) -> np.ndarray:
        """A uint8 tensor (packed codes such as MXFP4 blocks and scales), or its slice [index], as numpy."""
        return np.asarray(self._read(name, expected_shape, index, ("U8",), "packed codes must be U8"), dtype=np.uint8)

    def layer_indices(self, prefix: str = "model.layers.") -> set[int]:
        """Decoder-layer indices that tensor names mention (model.layers.<i>.)."""
        found = (re.match(re.escape(prefix) + r"(\d+)\.", name) for name in self._where)
        return {int(m.group(1)) for m in found if m}

    def _require(self, name: str) -> None:
        if name not in self._where:
            raise CheckpointError(f"checkpoint has no tensor {name}")
