"""manifest.json of a converted model: its schema, its checksum, the paths it names, unfinished output.

The manifest is read before anything else of a model directory and is not trusted: it is checked
against a schema (types, required keys), every path it names must stay inside the model
directory, and `verify=True` also checks its own sha256 (which covers the config it carries)
besides the weight files' checksums. A directory that a conversion is still writing, or that a
killed conversion left behind, carries a marker file and never loads.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

from jmoe import validate
from jmoe.config import ModelConfig
from jmoe.errors import ConfigError, FormatError
from jmoe.format import DENSE_DIR, EXPERTS_DIR
from jmoe.tiers import TIER_BITS, TIER_NAMES
from kernel_formats.qarray import QuantFormat

FORMAT_NAME = "jmoe"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
CHECKSUM_KEY = "manifest_sha256"
# Written first into a conversion's temporary directory (who is writing it), removed last.
PARTIAL_MARKER = ".jmoe-convert.json"
PARTIAL_SUFFIX = ".partial"
# Dense tiers (`jmoe convert --dense-tier`): the dense projections, LM head and embedding table at
# bf16 or as QArrays; norms, routers and biases stay float. A manifest without "tier" is bf16.
DENSE_TIERS = ("bf16", "int8", "int6", "int4")
DENSE_TIER_BITS = {"bf16": 16, "int8": 8, "int6": 6, "int4": 4}


# ---------------------------------------------------------------- a small schema language
# A schema is a Python type, a rule below, or a dict of keys to schemas (a key ending in "?" is
# optional; keys not listed are refused).


class Rule:
    def check(self, value: Any, where: str) -> None:
        raise NotImplementedError


class Int(Rule):
    def __init__(self, minimum: int = 0):
        self.minimum = minimum

    def check(self, value, where):
        validate.integer(where, value, minimum=self.minimum, error=FormatError)


class Text(Rule):
    def __init__(self, pattern: str | None = None, what: str = "a string"):
        self.pattern, self.what = pattern, what

    def check(self, value, where):
        if not isinstance(value, str) or (self.pattern and not re.fullmatch(self.pattern, value)):
            raise FormatError(f"{where} must be {self.what}, got {validate._shown(value)}")


class Const(Rule):
    def __init__(self, value):
        self.value = value

    def check(self, value, where):
        if value != self.value or type(value) is not type(self.value):
            raise FormatError(f"{where} must be {self.value!r}, got {validate._shown(value)}")


class Maybe(Rule):
    def __init__(self, schema):
        self.schema = schema

    def check(self, value, where):
        if value is not None:
            check_schema(value, self.schema, where)


class Items(Rule):
    def __init__(self, schema):
        self.schema = schema

    def check(self, value, where):
        if not isinstance(value, list):
            raise FormatError(f"{where} must be a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            check_schema(item, self.schema, f"{where}[{i}]")


class Entries(Rule):
    """An object with free keys (each checked by `key`) whose values all follow one schema."""

    def __init__(self, schema, key: Rule = Text()):
        self.schema, self.key = schema, key

    def check(self, value, where):
        if not isinstance(value, dict):
            raise FormatError(f"{where} must be an object, got {type(value).__name__}")
        for name, item in value.items():
            self.key.check(name, f"{where} key {name!r}")
            check_schema(item, self.schema, f"{where}[{name!r}]")


class Anything(Rule):
    def check(self, value, where):
        pass


def check_schema(value: Any, schema, where: str) -> None:
    if isinstance(schema, Rule):
        schema.check(value, where)
    elif isinstance(schema, dict):
        if not isinstance(value, dict):
            raise FormatError(f"{where} must be an object, got {type(value).__name__}")
        names = {key.rstrip("?"): key for key in schema}
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise FormatError(f"{where} has unknown key(s) {', '.join(map(repr, unknown))}")
        for name, key in names.items():
            if name in value:
                check_schema(value[name], schema[key], f"{where}.{name}")
            elif not key.endswith("?"):
                raise FormatError(f"{where} is missing {name!r}")
    elif isinstance(schema, type):
        if not isinstance(value, schema) or (schema is not bool and isinstance(value, bool)):
            raise FormatError(f"{where} must be {schema.__name__}, got {validate._shown(value)}")
    else:  # pragma: no cover - a schema bug, not bad input
        raise TypeError(f"bad schema at {where}: {schema!r}")


RELPATH = Text(r"[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*", "a relative path inside the model directory")
SHA256 = Text(r"[0-9a-f]{64}", "a sha256 hex digest")
TIER_FORMAT = {"bits": Int(1), "group_size": Int(1), "symmetric": bool, "act_bits": Maybe(Int(1)), "smooth": bool,
               "tiled?": bool, "scale_bits?": Int(8)}
LEAF = {"name": str, "shape": Items(Int(0)), "dtype": str, "offset": Int(0)}
SCHEMA = {
    "format": Const(FORMAT_NAME),
    "format_version": Const(FORMAT_VERSION),
    "family": str,
    "source": str,
    "config": dict,  # checked field by field by ModelConfig
    "hf_config": dict,
    "quantization": {"method": Text(r"rtn|gptq|haq", "rtn, gptq or haq"), "calibration?": Anything(),
                     "haq_alpha?": Anything()},
    "tiers": Entries({"format": Maybe(TIER_FORMAT), "tiled?": bool, "record_nbytes": Int(1), "leaves": Items(LEAF)},
                     key=Text("|".join(TIER_NAMES), f"a tier ({', '.join(TIER_NAMES)})")),
    "dense": {"dir": RELPATH, "tier?": Text("|".join(DENSE_TIERS), f"a dense tier ({', '.join(DENSE_TIERS)})"),
              "format?": Maybe(TIER_FORMAT), "bytes?": Int(0),
              "head_tier?": Text("|".join(DENSE_TIERS), f"a dense tier ({', '.join(DENSE_TIERS)})"),
              "head_format?": Maybe(TIER_FORMAT), "method?": Text("gptq", "gptq"),
              "head_rows?": {"bits": Const(8), "group_size": Const(32), "top": Int(1)},
              "head_method?": Text("gptq", "gptq"),
              "tiled_kernels?": bool,
              "tensors": Entries({"hf_name": str, "shape": Items(Int(0)), "dtype": str})},
    "tokenizer": Maybe(RELPATH),
    "files": Entries({"bytes": Int(0), "sha256": SHA256}, key=RELPATH),
    CHECKSUM_KEY: SHA256,
}


# ---------------------------------------------------------------- checksums and paths


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's canonical JSON, without the checksum itself."""
    body = {k: v for k, v in manifest.items() if k != CHECKSUM_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest as written by the converter: format name, version and its own checksum."""
    sealed = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **manifest}
    sealed[CHECKSUM_KEY] = manifest_checksum(sealed)
    return sealed


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def inside(root: Path, rel: str) -> Path:
    """root / rel, refusing a path that leaves the model directory (by '..' or by a symlink)."""
    parts = PurePosixPath(rel).parts
    if PurePosixPath(rel).is_absolute() or ".." in parts or not parts:
        raise FormatError(f"{root}: manifest path {rel!r} is not a relative path inside the model directory")
    full = Path(root) / rel
    if not full.resolve().is_relative_to(Path(root).resolve()):
        raise FormatError(f"{root}: {rel} leads out of the model directory (a symbolic link?); refusing it")
    return full


# ---------------------------------------------------------------- reading


def partial_reason(root: Path) -> str | None:
    """Why `root` is an unfinished conversion's directory, or None."""
    if root.name.endswith(PARTIAL_SUFFIX):
        return f"{root} is a conversion's temporary directory"
    if (root / PARTIAL_MARKER).exists():
        return f"{root} holds {PARTIAL_MARKER}: its conversion did not finish"
    return None


def read_json(root: Path) -> dict[str, Any]:
    return validate.read_json_object(Path(root) / MANIFEST, what="jmoe manifest", error=FormatError)


def is_jmoe_output(root: Path) -> bool:
    """Whether `root` holds a manifest written by `jmoe convert` (this format version or an earlier one)."""
    if not (Path(root) / MANIFEST).is_file():
        return False
    try:
        manifest = read_json(root)
    except FormatError:
        return False
    if manifest.get("format") == FORMAT_NAME:
        return True
    return isinstance(manifest.get("format_version"), int) and {"files", "tiers", "config"} <= set(manifest)


def read_manifest(root: Path, *, verify: bool = False) -> dict[str, Any]:
    """The validated manifest of a converted model; `verify` also checks the manifest's sha256."""
    root = Path(root)
    if not root.is_dir():
        raise FormatError(f"{root} is not a directory (expected a model written by `jmoe convert`)")
    reason = partial_reason(root)
    if reason:
        raise FormatError(f"{reason}; it never loads. Convert the model again.")
    if not (root / MANIFEST).is_file():
        raise FormatError(f"{root} has no {MANIFEST}: not a jmoe model, or its conversion did not finish")
    manifest = read_json(root)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise FormatError(
            f"{root} has format version {version!r}; this jmoe reads version {FORMAT_VERSION}. Convert the model again."
        )
    check_schema(manifest, SCHEMA, MANIFEST)
    if verify and manifest_checksum(manifest) != manifest[CHECKSUM_KEY]:
        raise FormatError(f"{root}/{MANIFEST} does not match its sha256 checksum (edited or corrupt)")
    _check_consistency(root, manifest)
    return manifest


def _check_consistency(root: Path, manifest: dict[str, Any]) -> None:
    try:
        cfg = ModelConfig.from_dict(manifest["config"])
    except ConfigError as e:
        raise FormatError(f"{MANIFEST}: config: {e}") from None
    if manifest["family"] != cfg.family:
        raise FormatError(f"{MANIFEST}: family {manifest['family']!r} differs from the config's {cfg.family!r}")
    for tier, entry in manifest["tiers"].items():
        fmt = entry["format"]
        if (fmt is None) != (tier == "bf16") or (fmt is not None and fmt["bits"] != TIER_BITS[tier]):
            raise FormatError(f"{MANIFEST}: tiers.{tier}.format does not describe a {tier} tier")
    dense_tier, dense_fmt = manifest["dense"].get("tier", "bf16"), manifest["dense"].get("format")
    if (dense_fmt is None) != (dense_tier == "bf16") or (dense_fmt
                                                        and dense_fmt["bits"] != DENSE_TIER_BITS[dense_tier]):
        raise FormatError(f"{MANIFEST}: dense.format does not describe dense tier {dense_tier}")
    if ("head_tier" in manifest["dense"]) != ("head_format" in manifest["dense"]):
        raise FormatError(f"{MANIFEST}: dense.head_tier and dense.head_format come together")
    head_tier = manifest["dense"].get("head_tier", dense_tier)
    head_fmt = manifest["dense"].get("head_format", dense_fmt)
    if (head_fmt is None) != (head_tier == "bf16") or (head_fmt and head_fmt["bits"] != DENSE_TIER_BITS[head_tier]):
        raise FormatError(f"{MANIFEST}: dense.head_format does not describe head tier {head_tier}")
    if "head_rows" in manifest["dense"] and head_fmt is None:
        raise FormatError(f"{MANIFEST}: dense.head_rows refines an integer head: the head tier is bf16")
    for rel in [*manifest["files"], manifest["dense"]["dir"], manifest["tokenizer"]]:
        if rel is not None:
            inside(root, rel)


def dense_format(manifest: dict[str, Any]) -> QuantFormat | None:
    """The format the dense weights are stored in (None: bf16 arrays), for building the model."""
    return _format(manifest["dense"].get("format"), "dense.format")


def tiled_kernels(manifest: dict[str, Any]) -> bool:
    """Whether the plain dense projections are stored in the CPU layout (jmoe.layers.linear.Linear.tiled)."""
    return bool(manifest["dense"].get("tiled_kernels", False))


def head_format(manifest: dict[str, Any]):
    """The format of the LM head and embedding table (a manifest without dense.head_format stores
    them at the dense tier): a QuantFormat, None (bf16), or with dense.head_rows a RefinedHead
    (jmoe/layers/refined_head.py) of the head's format."""
    if "head_format" not in manifest["dense"]:
        return dense_format(manifest)
    fmt = _format(manifest["dense"]["head_format"], "dense.head_format")
    if "head_rows" in manifest["dense"]:
        from jmoe.layers.refined_head import RefinedHead

        return RefinedHead(fmt, manifest["dense"]["head_rows"]["top"])
    return fmt


def _format(fmt: dict | None, where: str) -> QuantFormat | None:
    try:
        return None if fmt is None else QuantFormat.from_json(fmt)
    except ValueError as e:
        raise FormatError(f"{MANIFEST}: {where}: {e}") from None


def check_files(root: Path, manifest: dict[str, Any], *, verify_checksums: bool) -> None:
    """Every weight file exists with its recorded size (and sha256 when asked).

    Tokenizer files are listed too but not checked: editing a chat template is legitimate.
    """
    for rel, info in manifest["files"].items():
        if not rel.startswith((f"{DENSE_DIR}/", f"{EXPERTS_DIR}/")):
            continue
        path = inside(root, rel)
        if not path.is_file():
            raise FormatError(f"{root} is missing {rel}")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise FormatError(f"{rel} has {size} bytes, the manifest says {info['bytes']} (truncated or replaced)")
        try:
            if verify_checksums and sha256_file(path) != info["sha256"]:
                raise FormatError(f"{rel} does not match its sha256 checksum (corrupt file)")
        except OSError as e:
            raise FormatError(f"cannot read {path}: {e.strerror or e}") from None
