"""The check every decoding function makes of its model, below the loader: a model is what jmoe.load
returned when it derives from LoadedModel (jmoe.runtime.loader.JmoeModel does), so these modules need
not import the loader, which imports them."""

from __future__ import annotations

from jmoe.errors import InputError


class LoadedModel:
    """The base class of what jmoe.load returns (jmoe.runtime.loader.JmoeModel)."""

    __slots__ = ()


def check_model(model) -> None:
    if not isinstance(model, LoadedModel):
        raise InputError(f"model must be what jmoe.load returned, got {type(model).__name__}")
