"""Shared building blocks of every family (Flax NNX): norms, rotary embeddings, attention, MLPs,
the sparse block with its routed experts, the decoder layer and the stack.

Numerics follow Hugging Face transformers: RMSNorm in float32 then cast, RoPE tables in float32,
attention softmax in float32, router softmax in float32. Family differences arrive as ModelConfig
flags. Routed experts are not parameters here: they live in device pools and are reached through
the handle table (jmoe/layers/experts.py), so residency changes pool contents, never the model.
"""
