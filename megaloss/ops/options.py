"""What every options class of megaloss shares: the base :class:`OptionsBase`, the checks of
their fields (each raising a ValueError / TypeError that names the field), and how an entry
point takes its options (:func:`resolve_options`, :func:`module_options`).

Each options class is a frozen dataclass on :class:`OptionsBase`, defined beside what reads it:
the chunk kernels' options here in :mod:`megaloss.ops` (:mod:`.cross_entropy_options`,
:mod:`.log_probs_options`, :mod:`.distillation_options`: the kernels take them), the other
losses' beside their loss in :mod:`megaloss.losses` (``MNROptions`` in :mod:`~megaloss.losses.mnr`,
``PolicyLossOptions`` in :mod:`~megaloss.losses.policy_options`, ``DPOOptions``,
``CPOOptions``, ``ORPOOptions``, ``KTOOptions`` in their loss's module).

An option is spelled twice: the dataclass field (its type, default and check) and the entry
point's keyword of the same name and default (its signature, which a test compares with the
fields). The entry point hands its arguments over by name, ``opts = resolve_options(
CrossEntropyOptions, options, locals())`` as its first statement, so no third list of the
options is written anywhere.
"""
from __future__ import annotations

import math
from dataclasses import Field, fields, replace
from typing import Any, Dict, Mapping, Optional, Tuple, Type, TypeVar

import torch

__all__ = ["OptionsBase", "resolve_options", "module_options", "option_values"]

OptionsT = TypeVar("OptionsT", bound="OptionsBase")


class OptionsBase:
    """What every frozen options dataclass of megaloss shares."""

    def replace(self: OptionsT, **changes: Any) -> OptionsT:
        """A copy with ``changes`` applied (validated again).

        Raises:
            ValueError / TypeError: a changed field out of range or of the wrong type.
        """
        return replace(self, **changes)

    def as_dict(self) -> Dict[str, Any]:
        """``{field name: value}`` in field order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_float(name: str, value: Any, low: float, high: float, *, open_low: bool = False,
                 none_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (value > low if open_low else value >= low) and value <= high
    if not ok:
        rng = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        extra = "None or " if none_ok else ""
        raise ValueError(f"{name} must be {extra}a float in {rng}, got {value!r}")


def bad_chunk_size(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < 1


def check_choice(name: str, value: Any, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def finite_positive_error(name: str, value: Any) -> Optional[ValueError]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isinf(value):
        return ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return None


def check_finite_positive(name: str, value: Any) -> None:
    error = finite_positive_error(name, value)
    if error is not None:
        raise error


def check_softcapping(options: Any, name: str) -> None:
    """A soft-capping field of a frozen options object: ``None``, or made a float ``> 0``."""
    value = getattr(options, name)
    if value is not None:
        check_float(name, value, 0.0, float("inf"), open_low=True, none_ok=True)
        object.__setattr__(options, name, float(value))


def check_chunk_fields(options: Any) -> None:
    """The fields every chunked lm_head loss has: ``chunk_size``, ``accum_dtype``,
    ``ignore_index``."""
    if options.chunk_size is not None and bad_chunk_size(options.chunk_size):
        raise ValueError(f"chunk_size must be None or an int >= 1, got {options.chunk_size!r}")
    dtype = options.accum_dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"accum_dtype must be a floating torch.dtype, got {dtype!r}")
    if isinstance(options.ignore_index, bool) or not isinstance(options.ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {options.ignore_index!r}")


def _class_fields(cls: Type[OptionsBase]) -> Tuple[Field, ...]:
    """``dataclasses.fields(cls)`` of an options class (which has no ``ClassVar`` / ``InitVar``
    pseudo-fields), read from ``__dataclass_fields__``: under ``torch.compile`` Dynamo traces
    ``dataclasses.fields`` of an instance only, and of a class it breaks the graph."""
    return tuple(cls.__dataclass_fields__.values())


def option_values(cls: Type[OptionsBase], arguments: Mapping[str, Any]) -> Dict[str, Any]:
    """``{field name: value}`` of the fields of ``cls`` that ``arguments`` (a call's arguments
    by name) holds."""
    return {f.name: arguments[f.name] for f in _class_fields(cls) if f.name in arguments}


def resolve_options(cls: Type[OptionsT], options: Optional[OptionsT],
                    arguments: Mapping[str, Any]) -> OptionsT:
    """The options of a call that takes ``options=`` *or* the option fields as keywords.

    Args:
        cls: the options class (a frozen dataclass on :class:`OptionsBase`).
        options: the ``options=`` argument (``None``: build the options from ``arguments``).
        arguments: the call's arguments by name, ``locals()`` as the entry point's first
            statement: the value of each field of ``cls`` is read under the field's name (a
            field it lacks keeps its default); other names are ignored.

    Raises:
        TypeError: ``options`` is not a ``cls``; or ``options`` given together with keywords
            that are not at their default, naming them.
        ValueError: an option out of range (from ``cls``).
    """
    keywords = option_values(cls, arguments)
    if options is None:
        return cls(**keywords)
    if not isinstance(options, cls):
        raise TypeError(f"options must be a {cls.__name__}, got {type(options).__name__}")
    defaults = {f.name: f.default for f in _class_fields(cls)}
    clash = [k for k, v in keywords.items() if not _is_default(v, defaults[k])]
    if clash:
        raise TypeError(f"pass either options= or the option keywords, not both: got options= "
                        f"and {', '.join(clash)}")
    return options


def module_options(cls: Type[OptionsT], options: Optional[OptionsT],
                   option_fields: Dict[str, Any]) -> OptionsT:
    """The options of a loss module built with ``options=`` *or* the option fields as keyword
    arguments (only those given).

    Raises:
        TypeError: both given, or ``options`` not a ``cls``.
        ValueError: an option out of range (from ``cls``).
    """
    if options is None:
        return cls(**option_fields)
    if option_fields:
        raise TypeError("pass either options or its fields as keyword arguments, not both")
    if not isinstance(options, cls):
        raise TypeError(f"options must be a {cls.__name__}, got {type(options).__name__}")
    return options


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if isinstance(value, torch.Tensor) or isinstance(value, bool) != isinstance(default, bool):
        return False
    try:
        return bool(value == default)
    except Exception:  # a value without a plain comparison is not the default
        return False
