"""Hugging Face checkpoint -> jmoe directory (dense weights + every expert in several tiers)."""

from convert.pipeline import convert_checkpoint, parse_tiers

__all__ = ["convert_checkpoint", "parse_tiers"]
