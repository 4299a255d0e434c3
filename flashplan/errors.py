"""Exceptions raised by flashplan.

Every error about user input subclasses :class:`FlashplanError`, itself a
:class:`ValueError`, so callers that already catch ``ValueError`` keep working. Two more
live here so that every exception class of flashplan does: :class:`PlanIntegrityError`
(a planner bug found by a check) and :class:`MissingDependencyError` (an optional
package missing).
Messages name the offending field, the request index (when there is one) and the
values, in the spirit of xformers' index-bearing errors.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BucketError",
    "DeviceUnavailableError",
    "FieldTypeError",
    "FlashplanError",
    "LayoutError",
    "MissingDependencyError",
    "OptionError",
    "OptionTypeError",
    "PageTableError",
    "PlanIntegrityError",
    "PlanMismatchError",
    "RunTypeError",
    "UnsupportedError",
]


class FlashplanError(ValueError):
    """Base class of every flashplan input error.

    Every one names what is wrong as structured attributes, and its message is built
    from them (``"seq_lens[1]: must be >= 1 (value=0)"``).

    Attributes:
        field: name of the offending field or argument (``"seq_lens"``, ``"page_size"``,
            ``"kv_cache"``, ``"pages"`` …).
        message: what is wrong, without the field and values.
        request: index of the offending request in the batch, or ``None`` when the
            error is about the batch as a whole (or there is no batch).
        values: the offending values, as a mapping from name to value.
    """

    def __init__(
        self,
        field: str,
        message: str,
        *,
        request: int | None = None,
        **values: Any,
    ) -> None:
        self.field = field
        self.message = message
        self.request = request
        self.values = dict(values)
        where = f"{field}" if request is None else f"{field}[{request}]"
        detail = ", ".join(f"{k}={v!r}" for k, v in values.items())
        text = f"{where}: {message}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild from the fields (pickle, copy, multiprocessing), not from the message.
        return (_rebuild, (type(self), self.field, self.message, self.request, self.values))


def _rebuild(
    cls: type[FlashplanError],
    field: str,
    message: str,
    request: int | None,
    values: dict[str, Any],
) -> FlashplanError:
    return cls(field, message, request=request, **values)


class LayoutError(FlashplanError):
    """An input record or setting is invalid (a layout, group, heads, page table, plan
    record or executor option); attributes as :class:`FlashplanError`."""


class FieldTypeError(LayoutError, TypeError):
    """A field holds a value of the wrong type (a float where an int is needed, a
    string for a flag, a list that is not a sequence of ints, a record of another
    class). Both a :class:`FlashplanError` (so a ``ValueError``) and a ``TypeError``,
    with :class:`LayoutError`'s attributes."""


class OptionError(FlashplanError):
    """An executor setting is invalid (a policy, a compute dtype, a page map, a workspace
    size, a flag); attributes as :class:`FlashplanError`. Not a :class:`LayoutError`:
    the batch is fine, the executor is misconfigured."""


class OptionTypeError(OptionError, TypeError):
    """An executor setting of the wrong type: both an :class:`OptionError` and a
    ``TypeError``."""


def as_option(convert: Any, field: str, value: object, **kwargs: Any) -> Any:
    """``convert(field, value, **kwargs)`` (a converter of :mod:`flashplan.layout.convert`)
    for an executor setting: its refusals become :class:`OptionTypeError` /
    :class:`OptionError` with the same field, request and values."""
    try:
        return convert(field, value, **kwargs)
    except FieldTypeError as err:
        raise OptionTypeError(err.field, err.message, request=err.request, **err.values) from None
    except LayoutError as err:
        raise OptionError(err.field, err.message, request=err.request, **err.values) from None


class PageTableError(LayoutError):
    """A :class:`~flashplan.PageTable` cannot hold the batch it is applied with."""


class PlanMismatchError(FlashplanError):
    """A run's arguments contradict what was planned (group, window, dtypes, shapes), or
    a call comes out of order (``run`` before ``apply``); ``field`` names the argument."""


class RunTypeError(PlanMismatchError, TypeError):
    """An executor's ``apply`` / ``run`` argument of the wrong type (not a tensor, not a
    ``PlanSpec``, not a bool): both a :class:`PlanMismatchError` and the ``TypeError``
    a Python user expects."""


class UnsupportedError(FlashplanError):
    """The combination is valid in principle but not implemented by this planner or
    executor; ``field`` names the argument or setting that would have to change."""


class DeviceUnavailableError(UnsupportedError, RuntimeError):
    """The machine lacks what was asked for (no CUDA, no such CUDA device): a missing
    device rather than a bad value, so also the ``RuntimeError`` a Python user expects
    (and, as before, an :class:`UnsupportedError`)."""


class BucketError(LayoutError):
    """A plan does not fit the CUDA-graph bucket it is applied to, or a bucket is invalid."""


class PlanIntegrityError(AssertionError):
    """A plan's kernel calls read a key outside their group's key space, read one key
    twice, or read past a multi-item row (:func:`flashplan.materialize`,
    :mod:`flashplan.kernel_rules`): a planner bug, not bad input, hence an
    ``AssertionError`` rather than a :class:`FlashplanError`."""


class MissingDependencyError(RuntimeError):
    """An optional dependency (matplotlib, for ``explain --png``) is not installed."""
