"""Chat turns to prompt ids, and `jmoe chat`: an interactive terminal chat over the batching engine."""

from __future__ import annotations

import sys

from jmoe import harmony
from jmoe.decoding.sampling import SamplingOptions
from jmoe.serving.batcher import BatchEngine
from jmoe.serving.requests import Request
from jmoe.tokenizer import encode


def chat_prompt(model, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Messages ({role, content}) -> prompt ids: the model's chat template (given `tools`, OpenAI's
    function tools, when set), or for a base model without one (the bundled tiny one) a plain
    `role: content` transcript (jmoe.tokenizer.transcript)."""
    return encode(model.tokenizer, messages, model.config.vocab_size, tools=tools)


HELP = "/reset forgets the conversation, /quit (or Ctrl-D) leaves, /help shows this; Ctrl-C stops an answer"


def chat_loop(engine: BatchEngine, *, max_tokens: int, sampling: SamplingOptions, system: str | None = None,
              stdin=sys.stdin, stdout=sys.stdout) -> None:
    """Read a user turn per line, stream the answer, keep the history within the context."""
    model = engine.model
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    channels = harmony.uses_harmony(model.tokenizer)
    print(f"jmoe chat ({HELP})", file=stdout, flush=True)
    while True:
        print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line or line.strip() == "/quit":
            print(file=stdout, flush=True)
            return
        text = line.rstrip("\n")
        command = text.split()[0] if text.startswith("/") else None  # commands are chat's, never the model's
        if command == "/help":
            print(HELP, file=stdout, flush=True)
            continue
        if command == "/reset":
            history = history[:1] if system else []
            print("(conversation forgotten)", file=stdout, flush=True)
            continue
        if command is not None:
            print(f"(unknown command {command}; {HELP})", file=stdout, flush=True)
            continue
        if not text.strip():
            continue
        turn = history + [{"role": "user", "content": text}]
        ids = chat_prompt(model, turn)
        while len(ids) + max_tokens > engine.context and len(turn) > 1 + bool(system):  # oldest turns go first
            turn = turn[:bool(system)] + turn[bool(system) + 1:]
            ids = chat_prompt(model, turn)
        if len(ids) >= engine.context:
            print("(this message alone does not fit the context)", file=stdout, flush=True)
            continue
        stream = engine.submit(Request(ids, max_tokens, sampling, special_tokens=channels))
        answer, final = [], harmony.HarmonyStream() if channels else None
        try:
            for piece in stream:
                piece = final.feed(piece)[1] if final else piece  # harmony (GPT-OSS): the final channel
                answer.append(piece)
                print(piece, end="", file=stdout, flush=True)
        except KeyboardInterrupt:  # stops this answer, not the chat
            stream.cancel()
            print(" [stopped]", end="", file=stdout, flush=True)
        print(file=stdout, flush=True)
        history = turn + [{"role": "assistant", "content": "".join(answer).strip()}]

