"""Serving several requests at once: continuous batching over one loaded model."""

from jmoe.serving.batcher import BatchEngine
from jmoe.serving.requests import EngineClosed, QueueFull, Request, Stream

__all__ = ["BatchEngine", "EngineClosed", "QueueFull", "Request", "Stream"]
