"""The codec registry: names to factories, and the shared instance per (name, parameters)."""

from __future__ import annotations

import threading
from typing import Any, Callable

from luwu.protocol.codecs.base import Codec
from luwu.protocol.codecs.block import Int4Codec, Int8Codec
from luwu.protocol.codecs.dense import Bf16Codec, Fp16Codec, NoneCodec
from luwu.protocol.codecs.steps import Bf16StepsCodec
from luwu.protocol.codecs.topk import TopkCodec
from luwu.protocol.errors import ConfigError

_FACTORIES: dict[str, Callable[..., Codec]] = {}
_CACHE: dict[tuple, Codec] = {}
_LOCK = threading.Lock()


def register_codec(name: str, factory: Callable[..., Codec]) -> None:
    """Make ``get_codec(name, **params)`` build codecs with ``factory(**params)``."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"codec name must be a non-empty str, got {name!r}")
    with _LOCK:
        _FACTORIES[name] = factory
        for key in [k for k in _CACHE if k[0] == name]:
            del _CACHE[key]


def get_codec(name: str, **params: Any) -> Codec:
    """The shared codec instance for ``(name, params)``.

    ``name`` may carry the codec's first parameter after a colon, so that a
    header's codec string alone names a parametrized codec: ``"topk:0.05"``
    is ``get_codec("topk", density=0.05)``'s twin, ``"int8:128"`` an int8
    codec with blocks of 128.
    """
    key = (name, tuple(sorted(params.items())))
    codec = _CACHE.get(key)
    if codec is not None:
        return codec
    if not isinstance(name, str):
        raise ConfigError(f"codec name must be a str, got {name!r}")
    base, colon, arg = name.partition(":")
    factory = _FACTORIES.get(name) or (_FACTORIES.get(base) if colon else None)
    if factory is None:
        raise ConfigError(f"unknown codec {name!r}; known codecs: {', '.join(codec_names())}")
    args = (_parse_arg(arg),) if colon and name not in _FACTORIES else ()
    try:
        codec = factory(*args, **params)
    except TypeError as exc:
        raise ConfigError(f"codec {name!r}: bad parameters {params!r}: {exc}") from None
    with _LOCK:
        return _CACHE.setdefault(key, codec)


def _parse_arg(arg: str) -> int | float | str:
    for conv in (int, float):
        try:
            return conv(arg)
        except ValueError:
            pass
    return arg


def codec_names() -> list[str]:
    return sorted(_FACTORIES)


for _cls in (NoneCodec, Bf16Codec, Fp16Codec, Int8Codec, Int4Codec, TopkCodec, Bf16StepsCodec):
    register_codec(_cls.name, _cls)
