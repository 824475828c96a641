"""The `jmoe` command: convert a Hugging Face checkpoint, generate text, serve it over HTTP, describe a model."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from jmoe import validate
from jmoe.errors import InputError, JmoeError
from jmoe.runtime.collector import freeze_start_up, import_runtime
from jmoe.tokenizer import first_line

API_KEY_ENV = "JMOE_API_KEY"  # serve's API key when --api-key is not given
MAX_BATCH = 4096  # rows decoded together at most (serve's --max-batch, bench's -b)
MAX_SECONDS = 86400.0  # a day: the longest timeout an option takes
MAX_SEQ_LEN = 2**31 - 1  # positions are int32 in the step
# Set by the console script (entry): this process is the command's alone, so what start-up loads may be
# frozen out of the garbage collector's reach (jmoe/runtime/collector.py); main() called in-process may not.
_OWN_PROCESS = False


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (and exit status 2), like every other error."""

    def error(self, message: str):
        self.exit(2, f"jmoe: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="jmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    conv = sub.add_parser("convert", help="convert a Hugging Face MoE checkpoint (directory or hub id)")
    conv.add_argument("source", help="HF checkpoint directory, or a hub id like Qwen/Qwen3-30B-A3B (needs network)")
    conv.add_argument("-o", "--output", required=True, help="directory to write (must not exist unless --force)")
    conv.add_argument("--tiers", default="bf16", help="comma-separated expert tiers: bf16,int8,int4,int3,int2 (default: bf16)")
    conv.add_argument("--dense-tier", default="bf16",
                      help="attention, dense MLP and shared expert weights: bf16 (default), int8, int6, int4 (norms "
                           "and routers stay bf16)")
    conv.add_argument("--head-tier", default=None,
                      help="LM head and embedding table: bf16, int8, int6, int4 (default: int8 beside --dense-tier "
                           "int4, else the dense tier)")
    conv.add_argument("--method", default="rtn", help="quantizer for integer tiers: rtn (default), gptq, haq")
    conv.add_argument("--calib", action="append", default=[], help="calibration text file for gptq/haq (repeatable)")
    conv.add_argument("--calib-sequences", type=int, default=64, help="calibration windows (default 64)")
    conv.add_argument("--calib-seq-len", type=int, default=256, help="tokens per calibration window (default 256)")
    conv.add_argument("--group-size", type=int, default=None, help="group size along K (32, 64, 128)")
    conv.add_argument("--head-group-size", type=int, default=None,
                      help="the LM head and embedding table's group size along K (32, 64, 128; default: --group-size's, "
                           "else the head tier's: int6 32)")
    conv.add_argument("--refine-head", type=int, nargs="?", const=256, default=None, metavar="TOP",  # DEFAULT_TOP
                      help="an integer LM head refined per token: its TOP largest logits (default 256) computed "
                           "again from int8 rows stored beside it, which also hold the embedding table (with "
                           "--head-tier int4: 4.5 bits a weight read, about the int6 head's quality)")
    conv.add_argument("--symmetric", action="store_true", default=None, help="symmetric integer grids")
    conv.add_argument("--scale-bits", type=int, default=None,
                      help="8 or 16: the asymmetric expert tiers' scales and offsets as 8-bit codes or float16 "
                           "(default: int2 and int3 8, int4 16; int4 at 8 stores 4.25 bits per weight, for the CPU)")
    conv.add_argument("--w8a8", action="store_true", help="int8 tier as W8A8 (per-token int8 activations)")
    conv.add_argument("--cpu-layout", action="store_true",
                      help="expert tiers (bf16 too), dense weights (bf16 projections too) and LM head in the CPU "
                           "kernels' layout (column tiles they stream; GPU kernels leave such weights to the XLA "
                           "reference)")
    conv.add_argument("--force", action="store_true", help="replace an existing output directory")
    conv.add_argument("--no-progress", action="store_true", help="hide the progress bars")

    gen = sub.add_parser("generate", help="generate text from a converted model")
    gen.add_argument("model", help="directory written by `jmoe convert`")
    gen.add_argument("prompt", help="prompt text")
    add_model_options(gen)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    add_sampling_options(gen)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_speculative_options(gen, "default: chosen per cycle")
    gen.add_argument("--stats", action="store_true", help="print offload statistics (JSON) to stderr at the end")

    serve = sub.add_parser("serve", help="serve a converted model over an OpenAI-compatible HTTP API")
    serve.add_argument("model", help="directory written by `jmoe convert`")
    add_model_options(serve)
    add_prefix_option(serve)
    add_kv_cache_option(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch", type=int, default=8, help="requests decoded together (KV-cache rows)")
    serve.add_argument("--max-waiting", type=int, default=64, help="requests queued beyond those (then: 429)")
    add_speculative_options(serve, "default 3")
    serve.add_argument("--served-model-name", default=None, help="the model's name in the API (default: the directory's)")
    serve.add_argument("--reader-timeout", type=float, default=30.0,
                       help="seconds a request's output may wait unread (a client that stopped reading) before "
                            "the request is cut off and its slot freed (default 30)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds after which a request ends wherever it is (finish reason 'length'; default: none)")
    serve.add_argument("--max-tokens", type=int, default=None,
                       help="the most tokens a request may ask for (default: the context)")
    serve.add_argument("--idle-timeout", type=float, default=15.0,
                       help="seconds a connection may stay silent before it is closed (default 15)")
    serve.add_argument("--max-connections", type=int, default=256,
                       help="open connections at once; past them requests get 503 (default 256)")
    serve.add_argument("--drain-timeout", type=float, default=10.0,
                       help="on SIGINT/SIGTERM, seconds running requests get to finish before they are cut "
                            "(default 10)")
    serve.add_argument("--api-key", default=None,
                       help=f"clients must send 'Authorization: Bearer KEY' to /v1/*, /tokenize, /detokenize and "
                            f"/tokenizer_info (default: ${API_KEY_ENV} if set, else no key; the variable keeps it out "
                            "of ps)")
    serve.add_argument("--warm-up-echo", action="store_true",
                       help="compile echo's prompt scoring (completions' echo with logprobs) at start-up; else its "
                            "first request at each prompt-length bucket compiles it, pausing the engine meanwhile")
    serve.add_argument("--allowed-origins", default=None,
                       help="browser origins that may call the API (CORS): '*' or a comma-separated list such as "
                            "https://app.example.com (default: none)")

    chat = sub.add_parser("chat", help="chat with a converted model in the terminal")
    chat.add_argument("model", help="directory written by `jmoe convert`")
    add_model_options(chat)
    add_prefix_option(chat)
    chat.add_argument("--max-tokens", type=int, default=256, help="longest answer (default 256)")
    add_sampling_options(chat)
    chat.add_argument("--system", default=None, help="a system message opening the conversation")

    bench = sub.add_parser("bench", help="prefill (pp) and decode (tg) tokens/s, as llama-bench reports them")
    bench.add_argument("model", help="directory written by `jmoe convert`")
    add_model_options(bench)
    bench.add_argument("-p", "--prompt-lengths", default="512", help="comma-separated prompt lengths (pp rows)")
    bench.add_argument("-n", "--gen-lengths", default="128", help="comma-separated generation lengths (tg rows)")
    bench.add_argument("-b", "--batches", default="1", help="comma-separated batch sizes for the tg rows")
    bench.add_argument("-r", "--repetitions", type=int, default=3, help="timed runs per row (after one untimed)")
    bench.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")

    info = sub.add_parser("info", help="describe a converted model (tiers, bytes per expert)")
    info.add_argument("model")
    return parser


def add_model_options(p) -> None:
    """How a converted model is loaded: the options `generate` and `serve` share."""
    p.add_argument("--device-budget", default=None, help="device memory cap, e.g. 12GiB")
    p.add_argument("--policy", default=None,
                   help="expert residency: resident, ondemand, lru, lru+prefetch, lru+cpu, lru+prefetch+cpu, "
                        "dymoe, dynaexq (default: resident if every expert fits the budget, else lru+prefetch)")
    p.add_argument("--hi", default=None, help="dymoe/dynaexq: the high tier (default: --tier, else int4)")
    p.add_argument("--lo", default=None, help="dymoe/dynaexq: the low tier (default int2; dymoe: 'none' skips; "
                   "dynaexq: int3 where the budget holds every expert at int3 closes more of the gap to hi)")
    p.add_argument("--r", type=float, default=None, help="dymoe: mean share of routed experts at --hi (0.5-1)")
    p.add_argument("--hi-per-layer", type=int, default=None, help="dynaexq: hi copies per layer on average (default: budget)")
    p.add_argument("--hi-sets", default=None, choices=["model", "layer"],
                   help="dynaexq: the hottest experts of the whole model share the hi copies (model, the default), "
                        "or each layer holds --hi-per-layer of them (layer)")
    p.add_argument("--keep-lo", action="store_true", default=None,
                   help="dynaexq: keep every expert's lo version under its hi one (a demotion then copies "
                        "nothing, but the budget holds fewer hi experts than with one version each, the default)")
    p.add_argument("--execution", default="auto", choices=["auto", "layerwise", "resident"],
                   help="offloaded step: one jit per step falling back to layer-wise on a miss (auto), "
                        "layer-wise (host between layers), or one jit with replay (resident)")
    p.add_argument("--tier", default=None, help="expert precision tier")
    p.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--max-seq-len", type=int, default=None, help="context to plan memory for")
    p.add_argument("--kv-dtype", default=None, choices=["int8", "bfloat16", "fp8"],
                   help="KV cache dtype: int8 (a scale per token and head; a quarter of a float32 cache), "
                        "bfloat16 (half of one) or fp8 (float8_e4m3fn, no scale) instead of the compute dtype")
    p.add_argument("--cpu-dot", default="float", choices=["float", "int8"],
                   help="CPU products with quantized weights: float inputs (default) or inputs rounded to int8 "
                        "per group, as llama.cpp's Q8 dot (multiplied in integers, faster, on AVX-512 VNNI, and on "
                        "AVX2 for int4/int2; int3 on VNNI only); int8 also rounds the inputs of bf16 experts and bf16 "
                        "dense projections to bf16, as llama.cpp's BF16 dot (prefill on AVX-512 BF16)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads to compute with (default: $JMOE_THREADS, else the cores this process may use: "
                        "its CPU affinity, within its cgroup's CPU quota)")
    p.add_argument("--mesh", default=None, metavar="ep=N[,tp=M]",
                   help="expert parallelism: N expert shards (each on M devices); --device-budget is per device")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="run as one process of a jax.distributed job whose process 0 listens here "
                        "(or JMOE_COORDINATOR; python -m jmoe.launch sets it for local jobs)")
    p.add_argument("--num-processes", type=int, default=None, help="processes in the job (or JMOE_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, default=None, help="this process's id, 0..N-1 (or JMOE_PROCESS_ID)")


def add_prefix_option(p) -> None:
    p.add_argument("--prefix-cache", default="auto", metavar="SIZE",
                   help="device memory for prompt blocks kept for later prompts that start alike (a system "
                        "prompt, earlier turns), within --device-budget; auto (default): --max-seq-len tokens' "
                        "worth; 0: none")


def add_kv_cache_option(p) -> None:
    p.add_argument("--kv-cache", default="auto", metavar="SIZE",
                   help="device memory for the KV cache, which the --max-batch rows share page by page (a row "
                        "holds only the pages its tokens reach; when none are free the newest request waits "
                        "and is resumed later), within --device-budget; at least one --max-seq-len context; "
                        "auto (default): --max-batch whole contexts")


def add_speculative_options(p, k_default: str) -> None:
    p.add_argument("--speculative", default=None, metavar="TIER",
                   help="speculative decoding with the model's own copy at TIER (int4, int2) as the draft")
    p.add_argument("--draft-k", type=int, default=None, help=f"tokens drafted per cycle ({k_default})")


def load_model(args, **extra):
    """jmoe.load with the model options `add_model_options` gave the command."""
    import jmoe
    from jmoe.runtime.threads import limit_threads

    if args.max_seq_len is not None:
        validate.integer("max_seq_len", args.max_seq_len, minimum=2, maximum=MAX_SEQ_LEN)
    limit_threads(args.threads)  # before the CPU backend starts: it sizes its thread pool once

    model = jmoe.load(args.model, device_budget=args.device_budget, policy=cli_policy(args), tier=args.tier,
                      compute_dtype=args.dtype, kv_dtype=args.kv_dtype, max_seq_len=args.max_seq_len,
                      execution=args.execution,
                      cpu_dot=args.cpu_dot, mesh=args.mesh, **extra)
    if _OWN_PROCESS:
        freeze_start_up()
    return model


def cmd_convert(args) -> None:
    from convert import convert_checkpoint  # the converter lives beside the runtime

    calib = [f for item in args.calib for f in item.split(",") if f]
    out = convert_checkpoint(args.source, args.output, tiers=args.tiers, dense_tier=args.dense_tier,
                             head_tier=args.head_tier, method=args.method, calib=calib,
                             calib_sequences=args.calib_sequences, calib_seq_len=args.calib_seq_len,
                             group_size=args.group_size, head_group_size=args.head_group_size,
                             refine_head=args.refine_head,
                             symmetric=args.symmetric, scale_bits=args.scale_bits,
                             w8a8=args.w8a8, cpu_layout=args.cpu_layout,
                             overwrite=args.force, progress=not args.no_progress)
    print(f"wrote {out}", file=sys.stderr)


def cmd_generate(args) -> None:
    import jmoe
    from jmoe.decoding.generation import stop_strings

    sampling_options(args)  # bad generation options refused before the model loads
    validate.integer("max_new_tokens", args.max_new_tokens, minimum=1)
    stop_strings(args.stop)
    speculative = cli_speculative(args)
    model = load_model(args, draft=speculative.draft if speculative else None)
    pieces = jmoe.generate(model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                           seed=args.seed, stop=args.stop or None, stream=True, min_p=args.min_p,
                           presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                           speculative=speculative and dict(draft=speculative.draft, k=speculative.k or "auto"))
    from jmoe.distributed.processes import is_main_process

    out = sys.stdout if is_main_process() else open(os.devnull, "w")  # every process generates; one prints
    out.write(args.prompt)
    for piece in pieces:
        out.write(piece)
        out.flush()
    out.write("\n")
    if args.stats and is_main_process():
        print(json.dumps(jmoe.stats(model), indent=1), file=sys.stderr)


ENGINE_FAILED = 1  # `jmoe serve`'s exit status when its engine stopped on an error (a supervisor restarts it)
FOLLOWER_GRACE = 10.0  # seconds past the drain a stopped follower waits for process 0 to close


def cmd_serve(args) -> int:
    """Serve until SIGINT/SIGTERM (exit status 128 + the signal) or an engine failure (ENGINE_FAILED).
    In a job of several processes, process 0 serves and the others replay its engine's steps."""
    from jmoe.distributed.processes import process_id

    try:
        from jmoe.serving.server import Server  # noqa: F401 - uvicorn and FastAPI are there
    except ImportError as e:
        raise InputError(f"jmoe serve needs the serve extra: pip install -e '.[serve]' in the jmoe checkout "
                         f"({e})") from None
    server_options = serve_options(args)
    app_options(args)  # a bad key or origin is refused before the model loads
    # a follower notes a stop signal from the start, and stops when process 0 does, never mid-step
    stops = StopSignals() if process_id() != 0 else None
    speculative = cli_speculative(args)
    model = load_model(args, max_batch=args.max_batch, draft=speculative.draft if speculative else None,
                       prefix_cache=args.prefix_cache, kv_cache=args.kv_cache)
    print("jmoe: compiling the serving steps", file=sys.stderr)
    engine_options = dict(max_batch=args.max_batch, max_waiting=args.max_waiting, reader_timeout=args.reader_timeout,
                          speculative=speculative and dict(draft=speculative.draft, k=speculative.k or "auto"),
                          warm_up=True, warm_up_echo=args.warm_up_echo)
    if stops is not None:
        return follow(model, engine_options, stops, patience=server_options["drain_timeout"] + FOLLOWER_GRACE)
    return serve(args, model, engine_options, server_options)


def serve_options(args) -> dict:
    """serve's options checked (before the model loads); what the HTTP server takes of them."""
    validate.integer("max_batch", args.max_batch, minimum=1, maximum=MAX_BATCH)
    validate.integer("max_waiting", args.max_waiting, minimum=0)
    validate.integer("port", args.port, minimum=0, maximum=65535)
    validate.real("reader_timeout", args.reader_timeout, above=0.0, maximum=MAX_SECONDS)
    if args.request_timeout is not None:
        validate.real("request_timeout", args.request_timeout, above=0.0, maximum=MAX_SECONDS)
    if args.max_tokens is not None:
        validate.integer("max_tokens", args.max_tokens, minimum=1)
    return dict(host=args.host, port=args.port,
                idle_timeout=validate.real("idle_timeout", args.idle_timeout, above=0.0, maximum=MAX_SECONDS),
                max_connections=validate.integer("max_connections", args.max_connections, minimum=1),
                drain_timeout=validate.real("drain_timeout", args.drain_timeout, minimum=0.0, maximum=MAX_SECONDS))


def app_options(args) -> dict:
    """serve's options for the API itself (create_app's), checked: they are checked before the model
    loads too. The key comes from --api-key, else from $JMOE_API_KEY."""
    from jmoe.serving.middleware import check_api_key, parse_origins

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    origins = None if args.allowed_origins is None else parse_origins(args.allowed_origins)
    return dict(request_timeout=args.request_timeout, max_tokens=args.max_tokens,
                api_key=None if api_key is None else check_api_key(api_key), allowed_origins=origins)


def serve(args, model, engine_options: dict, server_options: dict) -> int:
    """Process 0 (or the only one): the engine behind the HTTP server, until it stops."""
    from pathlib import Path

    import jax

    from jmoe.serving import BatchEngine
    from jmoe.serving.mirror import Mirror
    from jmoe.serving.openai_api import create_app
    from jmoe.serving.server import Server

    name = args.served_model_name or Path(args.model).resolve().name
    logging.getLogger("jmoe.access").setLevel(logging.INFO)
    mirror = Mirror() if jax.process_count() > 1 else None
    with BatchEngine(model, mirror=mirror, **engine_options) as engine:
        options = app_options(args)
        server = Server(create_app(engine, name, **options), engine, **server_options)
        keyed = "; API key required" if options["api_key"] else ""
        print(f"jmoe: serving {name} on http://{args.host}:{args.port}/v1 ({args.max_batch} at once{keyed})",
              file=sys.stderr)
        server.run()
    if engine.failure is not None:
        print(f"jmoe: error: the serving engine failed ({engine.failure}); stopping", file=sys.stderr)
        return ENGINE_FAILED
    return 128 + server.stopped_by if server.stopped_by else 0


def follow(model, engine_options: dict, stops: StopSignals, patience: float) -> int:
    """Another process of the job: replay process 0's engine until it closes (or, `patience`
    seconds after a stop signal, without it)."""
    from jmoe.serving import BatchEngine
    from jmoe.serving.mirror import Mirror

    BatchEngine(model, mirror=Mirror(), follower=True, **engine_options).follow(give_up=lambda: stops.waited(patience))
    return 128 + stops.signal if stops.signal else 0


class StopSignals:
    """Notes SIGINT and SIGTERM instead of acting on them at once."""

    def __init__(self):
        self.signal: int | None = None
        self._at: float | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._note)

    def _note(self, sig, frame) -> None:
        if self.signal is None:
            self.signal, self._at = sig, time.monotonic()

    def waited(self, seconds: float) -> bool:
        """Whether a signal came more than `seconds` ago."""
        return self._at is not None and time.monotonic() - self._at > seconds


def add_sampling_options(parser) -> None:
    """The sampling flags generate and chat share (SamplingOptions' fields)."""
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off (default)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0,
                        help="OpenAI's, in [-2, 2]: lowers each token the output already holds (0 = off, default)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="OpenAI's, in [-2, 2]: lowers each token by how often the output holds it (0 = off, "
                             "default)")
    parser.add_argument("--seed", type=int, default=0)


def sampling_options(args):
    """SamplingOptions from add_sampling_options' flags (checked: a bad value raises InputError naming it)."""
    from jmoe.decoding.sampling import SamplingOptions

    return SamplingOptions(args.temperature, args.top_k, args.top_p, args.repetition_penalty, args.seed, args.min_p,
                           presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)


def cmd_chat(args) -> None:
    from jmoe.serving import BatchEngine
    from jmoe.serving.chat import chat_loop

    sampling = sampling_options(args)
    max_tokens = validate.integer("max_tokens", args.max_tokens, minimum=1)
    model = load_model(args, prefix_cache=args.prefix_cache)
    print("compiling (once per prompt length bucket)...", file=sys.stderr, flush=True)
    with BatchEngine(model, max_batch=1, warm_up=True) as engine:
        chat_loop(engine, max_tokens=max_tokens, sampling=sampling, system=args.system)


def int_list(name: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InputError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise InputError(f"{name} is empty")
    return values


def cmd_bench(args) -> None:
    from jmoe import bench

    lengths = dict(prompt_lengths=int_list("--prompt-lengths", args.prompt_lengths),
                   gen_lengths=int_list("--gen-lengths", args.gen_lengths),
                   batches=int_list("--batches", args.batches))
    validate.integer("repetitions", args.repetitions, minimum=1, maximum=bench.MAX_REPETITIONS)
    for b in lengths["batches"]:
        validate.integer("batch", b, minimum=1, maximum=MAX_BATCH)
    model = load_model(args, max_batch=max(lengths["batches"]))
    bench.check(model, repetitions=args.repetitions, **lengths)  # the lengths against the context
    rows = bench.run(model, repetitions=args.repetitions, **lengths)
    from jmoe.distributed.processes import is_main_process

    if is_main_process():  # every process measured the same steps
        print(json.dumps([r.as_dict() for r in rows], indent=1) if args.json else bench.table(rows))


def cli_speculative(args):
    from jmoe.decoding.speculative import SpeculativeOptions

    if args.speculative is None:
        if args.draft_k is not None:
            raise InputError("--draft-k needs --speculative TIER")
        return None
    return SpeculativeOptions.parse({"draft": args.speculative, "k": "auto" if args.draft_k is None else args.draft_k})


FLAGS = {"allocation": "hi_sets"}  # a policy option whose flag has another name


def cli_policy(args):
    """The policy the flags describe: a name, or DyMoE / DynaExq built from their options."""
    from jmoe.errors import InputError
    from jmoe.policies import make_policy

    dynamic = {"hi": args.hi, "lo": args.lo, "r": args.r, "hi_per_layer": args.hi_per_layer,
               "allocation": args.hi_sets, "keep_lo": args.keep_lo}
    given = {k: v for k, v in dynamic.items() if v is not None}
    if args.policy not in ("dymoe", "dynaexq"):
        if given:
            raise InputError(f"--{'/--'.join(FLAGS.get(k, k).replace('_', '-') for k in given)} only apply to "
                             "--policy dymoe/dynaexq")
        return args.policy
    allowed = {"dymoe": ("hi", "lo", "r"),
               "dynaexq": ("hi", "lo", "hi_per_layer", "allocation", "keep_lo")}[args.policy]
    wrong = [k for k in given if k not in allowed]
    if wrong:
        raise InputError(f"--{FLAGS.get(wrong[0], wrong[0]).replace('_', '-')} does not apply to --policy {args.policy}")
    if given.get("lo") == "none" and args.policy == "dymoe":
        given["lo"] = None
    hi = given.pop("hi", args.tier)
    if args.tier is not None and hi != args.tier:
        raise InputError(f"--tier {args.tier} differs from --hi {hi}")
    return make_policy(args.policy, hi, **given)


def cmd_info(args) -> None:
    from pathlib import Path

    from jmoe.manifest import read_manifest

    manifest = read_manifest(Path(args.model))
    cfg = manifest["config"]
    experts = sum(cfg["moe_layers"]) * cfg["num_experts"]
    summary = {
        "family": manifest["family"],
        "layers": cfg["num_layers"],
        "experts_per_layer": cfg["num_experts"],
        "top_k": cfg["top_k"],
        "tiers": {
            tier: {"bytes_per_expert": t["record_nbytes"], "total_expert_bytes": t["record_nbytes"] * experts}
            for tier, t in manifest["tiers"].items()
        },
        "dense": {"tier": manifest["dense"].get("tier", "bf16"), "bytes": manifest["dense"].get("bytes")},
    }
    print(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C stops jmoe even when it was started with SIGINT ignored (as a shell starts a background job)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    from jmoe.launch import dump_stacks_on_sigusr1

    dump_stacks_on_sigusr1()
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument already reported in one line
        return e.code if isinstance(e.code, int) else 2
    import_runtime()
    try:
        commands = {"convert": cmd_convert, "generate": cmd_generate, "serve": cmd_serve, "chat": cmd_chat,
                    "bench": cmd_bench, "info": cmd_info}
        joined = False
        if hasattr(args, "coordinator"):  # a command that loads a model may run as one of several processes
            from jmoe.distributed.processes import initialize, native_stdout_to_stderr

            joined = initialize(args.coordinator, args.num_processes, args.process_id)
            if joined:
                native_stdout_to_stderr()
            if joined and args.command == "chat":
                raise InputError("jmoe chat runs in one process (several processes: generate, serve, bench)")
        try:
            status = commands[args.command](args)
        except KeyboardInterrupt:
            if joined:
                os._exit(130)  # at once: JAX's shutdown would wait for the other processes
            raise
        except BaseException as e:
            if joined:  # the others cannot go on without this one: stop now, saying why
                from jmoe.distributed.processes import fail_stop

                fail_stop(e)
            raise
    except (JmoeError, OSError) as e:  # OSError: disk full, permission denied, a closed pipe
        message = first_line(e) if isinstance(e, JmoeError) else f"{e.strerror or e}: {e.filename or ''}".rstrip(": ")
        print(f"jmoe: error: {message}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - only the device running out of memory is the options' doing
        if type(e).__name__ != "JaxRuntimeError" or "RESOURCE_EXHAUSTED" not in str(e):
            raise
        print(f"jmoe: error: {first_line(e)} (lower --max-batch or --max-seq-len, or give --device-budget)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return status or 0


def entry() -> None:
    """The `jmoe` console script (and `python -m jmoe.cli`): main() in a process of its own."""
    global _OWN_PROCESS
    _OWN_PROCESS = True
    sys.exit(main())


if __name__ == "__main__":
    entry()
