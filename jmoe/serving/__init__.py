"""Serving several requests at once: continuous batching over one loaded model."""

from jmoe.serving.batcher import BatchEngine, QueueFull, Request, Stream

__all__ = ["BatchEngine", "QueueFull", "Request", "Stream"]
