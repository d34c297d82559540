"""A transparent stand-in for an HTTP client, so agentkv can tag its requests without patching it."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = ["Proxy"]

_T = TypeVar("_T")


class Proxy(Generic[_T]):
    """Forwards attribute reads and writes to the wrapped object.

    ``isinstance(proxy, type(wrapped))`` holds, because ``__class__`` reports the wrapped
    object's class: code that checks for ``openai.Stream`` or ``openai.OpenAI`` keeps working.
    Subclasses keep their own state in attributes named ``_agentkv_*``.
    """

    __wrapped__: _T

    def __init__(self, wrapped: _T) -> None:
        object.__setattr__(self, "__wrapped__", wrapped)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self.__wrapped__)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__wrapped__, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_agentkv_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.__wrapped__, name, value)

    def __dir__(self) -> list[str]:
        return sorted({*dir(self.__wrapped__), *object.__dir__(self)})

    def __repr__(self) -> str:
        return repr(self.__wrapped__)
