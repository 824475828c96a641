"""llama.cpp beside jmoe: find a build, convert a Hugging Face checkpoint to GGUF, run llama-bench.

Where llama.cpp is found:
  JMOE_LLAMA_CPP=/path/to/build/bin   the directory holding llama-bench and llama-quantize
                                      (else both are looked up on PATH);
  JMOE_LLAMA_CPP_SRC=/path/to/llama.cpp   the source tree holding convert_hf_to_gguf.py and gguf-py
                                      (else read from the build's CMakeCache.txt);
  JMOE_LLAMA_CPP_PYTHON=/path/to/python   the interpreter for convert_hf_to_gguf.py (default: this
                                      one; it needs torch, transformers, numpy, safetensors, pyyaml,
                                      tqdm, which jmoe's bench environment has, and for Mixtral also
                                      sentencepiece, which the converter imports; gguf-py is taken
                                      from the source tree).

Building it for CPU from the llama-cpp-python source distribution (the version the README's table
was measured with; 20-40 minutes on 2 cores):

    mkdir -p ~/llama-build && cd ~/llama-build
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36
    tar xzf llama_cpp_python-0.3.36.tar.gz
    cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release \\
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \\
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build build -j 2 --target llama-bench llama-quantize llama-perplexity llama-tokenize
    # where the CPU lists AMX but the machine does not run it (a virtual machine: llama-bench's
    # prompt runs then die of SIGILL in the Q4_0 path), configure with AMX off as well:
    #   "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" (and the same CMAKE_CXX_FLAGS)
    export JMOE_LLAMA_CPP=~/llama-build/build/bin
    # Mixtral only: an interpreter that sees jmoe's packages, plus sentencepiece
    python3 -m venv venv
    /path/to/jmoe/.venv/bin/python -c "import site; print(site.getsitepackages()[0])" \
        > venv/lib/python3.11/site-packages/jmoe-venv.pth
    venv/bin/pip install sentencepiece
    export JMOE_LLAMA_CPP_PYTHON=~/llama-build/venv/bin/python

The random checkpoints of bench/lib/random_checkpoint.py carry a tiny tokenizer padded to the real
vocabulary, which convert_hf_to_gguf.py refuses (it recognises a BPE pre-tokenizer by hashing how
it splits a test string). The GGUF is therefore converted from a sibling directory that links the
same weights and config and holds a tokenizer rebuilt from a vocabulary file llama.cpp ships:
GPT-2's (models/ggml-vocab-gpt-2.gguf), whose pre-tokenizer it recognises, for the families it
reads through its BPE path (Qwen3-MoE, GPT-OSS, DeepSeek-V2), and for Mixtral the Llama
SentencePiece vocabulary (models/ggml-vocab-llama-spm.gguf) written as a byte-fallback BPE
tokenizer.json, which its Llama path reads without a hash. The rest of the vocabulary is padding.
llama-bench feeds random token ids, so the tokenizer changes nothing it measures.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

QUANT_TYPES = ("BF16", "Q8_0", "Q4_K_M", "Q4_0")  # a bench's default
# Which jmoe tier each GGUF type is compared with (the nearest bits per expert weight); every type a
# bench may ask for.
JMOE_TIER_OF = {"BF16": "bf16", "Q8_0": "int8", "Q4_0": "int4", "Q4_K_M": "int4", "Q3_K_M": "int3"}


class LlamaCppMissing(RuntimeError):
    """No usable llama.cpp build (the message says what is missing and how to get it)."""


@dataclass(frozen=True)
class LlamaCpp:
    bin_dir: Path
    src_dir: Path
    python: str

    @property
    def bench(self) -> Path:
        return self.bin_dir / "llama-bench"

    @property
    def quantize_tool(self) -> Path:
        return self.bin_dir / "llama-quantize"

    def tool(self, name: str) -> Path:
        """Another of the build's programs (llama-perplexity, llama-tokenize); raises LlamaCppMissing."""
        path = self.bin_dir / name
        if not path.is_file():
            raise LlamaCppMissing(f"{self.bin_dir} holds no {name} (cmake --build build --target {name})")
        return path

    def version(self) -> str:
        proc = subprocess.run([str(self.bench), "--version"], capture_output=True, text=True)
        return (proc.stdout + proc.stderr).strip().splitlines()[0] if (proc.stdout + proc.stderr).strip() else "?"


def find_llama_cpp() -> LlamaCpp:
    """The llama.cpp build named by JMOE_LLAMA_CPP, else llama-bench on PATH; raises LlamaCppMissing."""
    env = os.environ.get("JMOE_LLAMA_CPP")
    if env:
        bin_dir = Path(env).expanduser()
        if not (bin_dir / "llama-bench").is_file():
            raise LlamaCppMissing(f"JMOE_LLAMA_CPP={env} holds no llama-bench (point it at the build's bin/)")
    else:
        found = shutil.which("llama-bench")
        if not found:
            raise LlamaCppMissing("llama-bench not found: set JMOE_LLAMA_CPP=/path/to/build/bin "
                                  "(bench/lib/llama_cpp.py says how to build it)")
        bin_dir = Path(found).resolve().parent
    if not (bin_dir / "llama-quantize").is_file():
        raise LlamaCppMissing(f"{bin_dir} has llama-bench but no llama-quantize (build both targets)")
    src = os.environ.get("JMOE_LLAMA_CPP_SRC")
    src_dir = Path(src).expanduser() if src else source_from_build(bin_dir)
    if src_dir is None or not (src_dir / "convert_hf_to_gguf.py").is_file():
        raise LlamaCppMissing("llama.cpp's source tree (convert_hf_to_gguf.py) not found: set "
                              "JMOE_LLAMA_CPP_SRC=/path/to/llama.cpp")
    return LlamaCpp(bin_dir, src_dir, os.environ.get("JMOE_LLAMA_CPP_PYTHON", sys.executable))


def source_from_build(bin_dir: Path) -> Path | None:
    """The source directory a CMake build was configured from (its CMakeCache.txt says)."""
    for build in (bin_dir.parent, bin_dir.parent.parent):
        cache = build / "CMakeCache.txt"
        if cache.is_file():
            m = re.search(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.+)$", cache.read_text(), re.MULTILINE)
            if m:
                return Path(m.group(1).strip())
    return None


# A GGUF's routed-expert tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps, ffn_gate_up_exps)
EXPERT_TENSOR = re.compile(r"ffn_(gate|up|down|gate_up)_exps")


def gguf_module(llama: LlamaCpp):
    """llama.cpp's own gguf-py package, from its source tree (the version its tools write)."""
    sys.path.insert(0, str(llama.src_dir / "gguf-py"))
    try:
        import gguf
    finally:
        sys.path.pop(0)
    return gguf


def vocab_gguf_fields(llama: LlamaCpp, name: str) -> dict:
    """The tokenizer fields of one of llama.cpp's vocabulary files (models/ggml-vocab-<name>.gguf)."""
    reader = gguf_module(llama).GGUFReader(str(llama.src_dir / "models" / f"ggml-vocab-{name}.gguf"))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}


def special(token_id: int, content: str) -> dict:
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def gpt2_tokenizer(llama: LlamaCpp) -> tuple[dict, dict]:
    """GPT-2's tokenizer.json and tokenizer_config.json (llama.cpp recognises its pre-tokenizer)."""
    f = vocab_gguf_fields(llama, "gpt-2")
    tokens, eos = f["tokenizer.ggml.tokens"], int(f["tokenizer.ggml.eos_token_id"])
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [special(eos, tokens[eos])],
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": list(f["tokenizer.ggml.merges"])},
    }
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": tokens[eos], "eos_token": tokens[eos],
              "add_bos_token": False}
    return tok, config


def llama_spm_tokenizer(llama: LlamaCpp) -> tuple[dict, dict]:
    """The Llama SentencePiece vocabulary as a byte-fallback BPE tokenizer.json (no merges: only
    the vocabulary reaches the GGUF), which llama.cpp's Llama path reads without a hash."""
    f = vocab_gguf_fields(llama, "llama-spm")
    tokens = f["tokenizer.ggml.tokens"]
    controls = [i for i, t in enumerate(f["tokenizer.ggml.token_type"]) if t in (2, 3)]  # unknown, control
    space = "\u2581"
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [special(i, tokens[i]) for i in controls],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": space}, {"type": "Replace", "pattern": {"String": " "}, "content": space}]},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": space}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": tokens[0], "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": []},
    }
    ids = {k: int(f[f"tokenizer.ggml.{k}_token_id"]) for k in ("bos", "eos", "unknown")}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokens[ids["bos"]],
              "eos_token": tokens[ids["eos"]], "unk_token": tokens[ids["unknown"]]}
    return tok, config


# Which rebuilt tokenizer each architecture's GGUF conversion gets.
TOKENIZER_FOR_ARCH = {
    "Qwen3MoeForCausalLM": gpt2_tokenizer,
    "GptOssForCausalLM": gpt2_tokenizer,
    "DeepseekV2ForCausalLM": gpt2_tokenizer,
    "MixtralForCausalLM": llama_spm_tokenizer,
}


def gguf_config(cfg: dict) -> dict:
    """The config.json llama.cpp's converter reads. llama.cpp knows DeepSeek-V2-Lite's full query
    projection (no q_lora_rank) only by its layer count (26 or 27) and otherwise requires the rank's
    key, so a slice with fewer layers states the rank as 0 (none), which it reads the same way."""
    if cfg["architectures"][0] == "DeepseekV2ForCausalLM" and cfg.get("q_lora_rank") is None:
        return dict(cfg, q_lora_rank=0)
    return cfg


def gguf_source(llama: LlamaCpp, checkpoint: Path, out: Path) -> Path:
    """A directory llama.cpp's converter accepts: links to the checkpoint's weights and config,
    and a tokenizer it reads (see the module docstring)."""
    checkpoint = Path(checkpoint).resolve()
    cfg = json.loads((checkpoint / "config.json").read_text())
    arch = cfg["architectures"][0]
    if arch not in TOKENIZER_FOR_ARCH:
        raise LlamaCppMissing(f"GGUF conversion of {arch} random checkpoints is not supported "
                              f"(supported: {', '.join(TOKENIZER_FOR_ARCH)})")
    tok, tok_config = TOKENIZER_FOR_ARCH[arch](llama)
    if cfg["vocab_size"] < len(tok["model"]["vocab"]):
        raise LlamaCppMissing(f"vocabulary {cfg['vocab_size']} is smaller than the rebuilt tokenizer's "
                              f"{len(tok['model']['vocab'])}")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in checkpoint.iterdir():
        if f.suffix == ".safetensors" or f.name == "model.safetensors.index.json":
            (out / f.name).symlink_to(f)
    (out / "config.json").write_text(json.dumps(gguf_config(cfg), indent=1))
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return out


def exit_reason(returncode: int) -> str:
    """A failed run's exit code in words; an illegal instruction names its likeliest cause."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if -returncode == signal.SIGILL:
        return (f"{name}: the build uses an instruction this machine does not run, most often AMX "
                "in a virtual machine whose CPU flags list it; rebuild with AMX off (module docstring)")
    return name


def run_measured(cmd: list[str], *, env: dict | None = None, cwd: Path | None = None,
                 log: Path | None = None) -> tuple[str, float, int]:
    """Run cmd; return (stdout, seconds, peak RSS bytes of that process alone, from wait4)."""
    t = time.perf_counter()
    with open(log or os.devnull, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=cwd, text=True)
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        tail = log.read_text()[-3000:] if log and log.exists() else ""
        raise RuntimeError(f"{' '.join(map(str, cmd[:3]))} ... failed ({exit_reason(proc.returncode)}):\n{tail}")
    return out, seconds, usage.ru_maxrss * 1024


# convert_hf_to_gguf.py with the name of the checkpoint's own BPE pre-tokenizer given rather than
# recognised by hashing (a model trained with a standard pre-tokenizer under a vocabulary llama.cpp
# has not seen, like the bundled tiny model's byte-level BPE with GPT-2's split rule).
CONVERT_WITH_PRE = """
import sys
pre = sys.argv.pop(1)
sys.argv[0] = "convert_hf_to_gguf.py"
import convert_hf_to_gguf as c
try:
    from conversion.base import TextModel
except ImportError:
    TextModel = c.TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
c.main()
"""


# A type named "<TYPE>-experts" quantizes only the routed experts (ffn_*_exps) to TYPE; every other
# matrix stays BF16, as jmoe's expert tiers leave a bf16 dense part.
EXPERTS_ONLY = "-experts"
KEEP_DENSE_BF16 = ["--token-embedding-type", "bf16", "--output-tensor-type", "bf16",
                   "--tensor-type", "attn_.*=bf16", "--tensor-type", "ffn_(gate|up|down)_shexp=bf16",
                   "--tensor-type", "ffn_(gate|up|down)\\.weight=bf16"]


def convert(llama: LlamaCpp, checkpoint: Path, work: Path, types=QUANT_TYPES,
            pretokenizer: str | None = None) -> dict[str, dict]:
    """The checkpoint as GGUF at each type (BF16 converted, the rest quantized from it); reuses
    files already there. Returns per type: path, seconds, peak RSS (None when reused). The BF16
    file is made only while a type asked for is missing, and reported only when asked for: once the
    quantized files are there, it may be deleted (at real shapes it is the largest of them).

    pretokenizer: convert with the checkpoint's own tokenizer, whose BPE pre-tokenizer llama.cpp
    knows by this name ("gpt-2", "qwen2", ...); without it the tokenizer is rebuilt from one of
    llama.cpp's vocabularies (random checkpoints: see the module docstring)."""
    work.mkdir(parents=True, exist_ok=True)
    bf16 = work / "model-BF16.gguf"
    made: dict[str, dict] = {}
    wanted = {qtype: bf16 if qtype == "BF16" else work / f"model-{qtype}.gguf" for qtype in types}
    if not bf16.is_file() and not all(path.is_file() for path in wanted.values()):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(llama.src_dir / "gguf-py"), str(llama.src_dir), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        tmp = work / "model-BF16.gguf.tmp"
        if pretokenizer:
            script = [llama.python, "-c", CONVERT_WITH_PRE, pretokenizer, str(Path(checkpoint).resolve())]
        else:
            script = [llama.python, str(llama.src_dir / "convert_hf_to_gguf.py"),
                      str(gguf_source(llama, checkpoint, work / "hf-src"))]
        _, seconds, rss = run_measured(script + ["--outtype", "bf16", "--outfile", str(tmp)],
                                       env=env, cwd=llama.src_dir, log=work / "convert.log")
        tmp.rename(bf16)
        made["BF16"] = {"seconds": seconds, "peak_rss_bytes": rss}
    out = {"BF16": {"path": str(bf16), **made.get("BF16", {"seconds": None, "peak_rss_bytes": None})}}
    if not bf16.is_file():  # deleted after quantizing, and not asked for
        del out["BF16"]
    for qtype in types:
        if qtype == "BF16":
            continue
        path = wanted[qtype]
        entry = {"seconds": None, "peak_rss_bytes": None}
        if not path.is_file():
            tmp = path.with_suffix(".gguf.tmp")
            base, experts_only = qtype.removesuffix(EXPERTS_ONLY), qtype.endswith(EXPERTS_ONLY)
            _, seconds, rss = run_measured([str(llama.quantize_tool), *(KEEP_DENSE_BF16 if experts_only else []),
                                            str(bf16), str(tmp), base, "2"], log=work / f"quantize-{qtype}.log")
            tmp.rename(path)
            entry = {"seconds": seconds, "peak_rss_bytes": rss}
        out[qtype] = {"path": str(path), **entry}
    for entry in out.values():
        entry["bytes"] = Path(entry["path"]).stat().st_size
    return out


def bench(llama: LlamaCpp, gguf: Path, *, threads: int = 2, prompt: int = 512, gen: int = 128,
          depths: tuple[int, ...] = (0, 512), log: Path | None = None) -> dict:
    """One llama-bench run (one repetition after its own warm-up): prefill tok/s over `prompt`
    tokens and decode tok/s over `gen` tokens at each depth, and the process's peak RSS."""
    cmd = [str(llama.bench), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(gen),
           "-d", ",".join(map(str, depths)), "-r", "1", "-o", "json"]
    out, seconds, rss = run_measured(cmd, log=log)
    result = {"peak_rss_bytes": rss, "wall_s": seconds}
    for test in json.loads(out):
        depth = test.get("n_depth", 0)
        if test["n_prompt"] and not test["n_gen"]:
            result["prefill_tok_s" if depth == 0 else f"prefill_tok_s@{depth}"] = test["avg_ts"]
        elif test["n_gen"] and not test["n_prompt"]:
            result[f"decode_tok_s@{depth}"] = test["avg_ts"]
    return result


# llama-perplexity and llama-tokenize read text files as they are (no \n escapes processed) and
# add no BOS (the bundled tiny model was trained without one).
TEXT_AS_IS = ["--no-escape"]
NO_BOS = ["--override-kv", "tokenizer.ggml.add_bos_token=bool:false"]


def tokenize(llama: LlamaCpp, gguf: Path, text_file: Path) -> list[int]:
    """llama.cpp's token ids for a text file under the GGUF's tokenizer, as llama-perplexity sees them."""
    out, _, _ = run_measured([str(llama.tool("llama-tokenize")), "-m", str(gguf), "-f", str(text_file), "--ids",
                              "--log-disable", "--no-bos", *TEXT_AS_IS])
    return json.loads(out)


# llama-perplexity's stdout and stderr are written by a logging thread that can lose the last lines
# (the final estimate and the last window's) at exit: a run that shows fewer windows than asked for
# is made again, up to this many runs in all.
PERPLEXITY_RUNS = 3


def perplexity(llama: LlamaCpp, gguf: Path, text_file: Path, *, ctx: int, chunks: int | None = None,
               threads: int = 2, log: Path) -> dict:
    """llama-perplexity over a text file: windows of `ctx` tokens, each scoring its second half
    (read from its output and the log it writes to stderr)."""
    cmd = [str(llama.tool("llama-perplexity")), "-m", str(gguf), "-f", str(text_file), "-c", str(ctx),
           "-t", str(threads), *TEXT_AS_IS, *NO_BOS] + (["--chunks", str(chunks)] if chunks else [])
    for _ in range(PERPLEXITY_RUNS):  # deterministic: a run again only recovers lines its logging lost
        out, seconds, _ = run_measured(cmd, log=log)
        try:
            result = {**read_perplexity(out, log.read_text()), "seconds": seconds}
        except RuntimeError as e:
            raise RuntimeError(f"{e} (see {log})") from None
        if chunks is None or result["chunks"] >= chunks:
            break
    return result


def read_perplexity(out: str, text: str) -> dict:
    """llama-perplexity's result from its stdout (`out`) and stderr log (`text`): the final estimate
    and the windows scored."""
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", text)
    # the running estimate after each window goes to stdout; the last one is the final estimate
    running = re.findall(r"\[(\d+)\]([0-9.]+),", out)
    if not final and not running:
        raise RuntimeError("llama-perplexity printed no estimate")
    ppl = float(final.group(1)) if final else float(running[-1][1])
    # the windows: all it set out to score where it reached its final estimate, else as far as the
    # running estimate went
    planned = re.search(r"calculating perplexity over (\d+) chunks", text)
    chunks = int(planned.group(1)) if final and planned else int(running[-1][0])
    return {"ppl": ppl, "plus_minus": float(final.group(2)) if final else None, "chunks": chunks}


def weight_bits(llama: LlamaCpp, gguf: Path) -> dict[str, float]:
    """Bits per weight in a GGUF, whatever types the quantizer chose: of the routed experts (its
    ffn_*_exps tensors) and of the rest of its matrices ("dense"; norms left out)."""
    sums = {"expert_bits": [0, 0], "dense_bits": [0, 0]}
    for tensor in gguf_module(llama).GGUFReader(str(gguf)).tensors:
        if len(tensor.shape) < 2:
            continue
        kind = "expert_bits" if EXPERT_TENSOR.search(tensor.name) else "dense_bits"
        sums[kind][0] += 8 * int(tensor.n_bytes)
        sums[kind][1] += int(tensor.n_elements)
    return {kind: bits / weights for kind, (bits, weights) in sums.items()}
