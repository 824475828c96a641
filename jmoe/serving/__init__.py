"""Serving several requests at once: continuous batching over one loaded model."""

from jmoe.serving.batcher import BatchEngine, EngineClosed, QueueFull, Request, Stream

__all__ = ["BatchEngine", "EngineClosed", "QueueFull", "Request", "Stream"]
