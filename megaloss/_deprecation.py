"""The machinery of renamed public names and keywords: the old spelling keeps working for one
release and emits a :class:`DeprecationWarning` that names its replacement (one place for the
wording). The deprecated functions themselves are :mod:`megaloss._deprecated`; the deprecated
methods of the loss modules are :class:`ReturnStatsAliases` here."""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Dict, TypeVar

__all__ = ["warn_renamed", "deprecated_alias", "renamed_keywords", "ReturnStatsAliases"]

F = TypeVar("F", bound=Callable[..., Any])


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new`` (``stacklevel`` 3: the caller of the
    function that calls this)."""
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new} "
                  f"instead", DeprecationWarning, stacklevel=stacklevel)


def deprecated_alias(func: F, old: str, new: str) -> F:
    """``func`` under its old name ``old``: same arguments and result, plus the warning."""

    @functools.wraps(func)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warn_renamed(old, new)
        return func(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old.rsplit(".", 1)[-1].split("(")[0]
    alias.__doc__ = f"Deprecated alias of :func:`{new}` (same arguments and result)."
    return alias  # type: ignore[return-value]


def renamed_keywords(**renames: str) -> Callable[[F], F]:
    """Decorator accepting the old keyword names ``renames`` (``old="new"``) of ``func``.

    An old keyword is passed on under its new name with a warning; giving both spellings is a
    :class:`TypeError` naming them."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _rename(func.__qualname__, kwargs, renames)
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def _rename(owner: str, kwargs: Dict[str, Any], renames: Dict[str, str]) -> None:
    for old, new in renames.items():
        if old not in kwargs:
            continue
        if new in kwargs:
            raise TypeError(f"{owner}() got both {old}= (deprecated) and {new}=; pass only {new}=")
        warn_renamed(f"{owner}({old}=...)", f"{new}=", stacklevel=4)
        kwargs[new] = kwargs.pop(old)


class ReturnStatsAliases:
    """The loss modules' renamed methods, in one place: ``forward_with_stats(...)`` (and MNR's
    older ``forward_with_metrics(...)``) are ``forward(..., return_stats=True)`` with a
    warning."""

    def forward_with_stats(self, *args: Any, **kwargs: Any) -> Any:
        """Deprecated: ``forward(..., return_stats=True)``."""
        warn_renamed(f"{type(self).__name__}.forward_with_stats", "forward(..., return_stats=True)")
        return self.forward(*args, return_stats=True, **kwargs)

    def forward_with_metrics(self, *args: Any, **kwargs: Any) -> Any:
        """Deprecated: ``forward(..., return_stats=True)`` (formerly ``forward_with_stats``)."""
        warn_renamed(f"{type(self).__name__}.forward_with_metrics",
                     "forward(..., return_stats=True) (formerly forward_with_stats)")
        return self.forward(*args, return_stats=True, **kwargs)
