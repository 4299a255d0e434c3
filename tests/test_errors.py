"""Every flashplan exception lives in ``flashplan.errors``; a wrong type is refused with
an error that is both a ``FlashplanError`` and a ``TypeError`` and names its field."""

from __future__ import annotations

import inspect
import pickle

import numpy as np
import pytest
import torch

import flashplan as fp
import flashplan.errors as errors
from flashplan.errors import FieldTypeError, FlashplanError, LayoutError

#: (what is wrong, a call with that wrong type, the field named)
WRONG_TYPES = [
    ("float page size", lambda: fp.BatchLayout.decode([3], page_size=1.5), "page_size"),
    ("str lengths", lambda: fp.BatchLayout.decode("123"), "seq_lens"),
    ("bool length", lambda: fp.BatchLayout.decode([3, True]), "seq_lens"),
    ("object length", lambda: fp.BatchLayout.decode([3, "4"]), "seq_lens"),
    ("non-integral float", lambda: fp.BatchLayout.decode(np.array([3.5])), "seq_lens"),
    ("bool tensor", lambda: fp.BatchLayout.decode(torch.tensor([True])), "seq_lens"),
    ("int flag", lambda: fp.AttentionGroup(causal=1), "causal"),
    ("str soft cap", lambda: fp.AttentionGroup(logits_soft_cap="30"), "logits_soft_cap"),
    ("group list", lambda: fp.BatchLayout.decode([3], groups=[fp.AttentionGroup(), 3]), "groups"),
    ("groups str", lambda: fp.BatchLayout.decode([3], groups="full"), "groups"),
    ("draft", lambda: fp.BatchLayout.verify([3], draft=[[-1, 0]]), "draft"),
    ("layout", lambda: fp.plan("layout", fp.HeadConfig(8, 2, 64)), "layout"),
    ("heads", lambda: fp.plan(fp.BatchLayout.decode([3]), (8, 2, 64)), "heads"),
    ("cached flags", lambda: fp.BatchLayout.decode([3], encoder_lens=[2], encoder_cached=[1]),
     "encoder_cached"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "call", "field"), WRONG_TYPES, ids=[w[0] for w in WRONG_TYPES])
def test_a_wrong_type_is_a_flashplan_type_error_naming_its_field(
    what: str, call: object, field: str
) -> None:
    with pytest.raises(FieldTypeError) as info:
        call()  # type: ignore[operator]
    err = info.value
    assert isinstance(err, FlashplanError) and isinstance(err, ValueError)
    assert isinstance(err, TypeError) and isinstance(err, LayoutError)
    assert err.field == field, (what, err)
    again = pickle.loads(pickle.dumps(err))  # rebuilt from its fields, same class
    assert type(again) is FieldTypeError and again.field == field


def test_a_wrong_value_of_the_right_type_is_no_type_error() -> None:
    for call in (
        lambda: fp.BatchLayout.decode([3], page_size=0),
        lambda: fp.BatchLayout.decode([3, -1]),
        lambda: fp.AttentionGroup(window_left=-2),
    ):
        with pytest.raises(LayoutError) as info:
            call()
        assert not isinstance(info.value, TypeError), info.value


def test_every_exception_class_lives_in_errors() -> None:
    """No module of flashplan defines an exception class outside ``flashplan.errors``."""
    import importlib
    import pkgutil

    homes = {}
    for mod in pkgutil.walk_packages(fp.__path__, "flashplan."):
        if mod.name.startswith(("flashplan.kernels", "flashplan.executor.flashinfer")):
            continue  # import Triton / FlashInfer; checked by the grep below instead
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            is_error = inspect.isclass(obj) and issubclass(obj, BaseException)
            if is_error and obj.__module__.startswith("flashplan"):
                homes[name] = obj.__module__
    assert homes and set(homes.values()) == {"flashplan.errors"}, homes
    assert set(errors.__all__) >= set(homes)


def test_no_module_defines_an_exception_class_outside_errors() -> None:
    """The same by reading every source file (the GPU modules included): an exception
    class is defined in errors.py only (warnings may live where they are raised)."""
    import re
    from pathlib import Path

    root = Path(fp.__file__).parent
    pattern = re.compile(r"^class (\w+)\((.*)\):", re.M)
    found = []
    for path in root.rglob("*.py"):
        for name, bases in pattern.findall(path.read_text()):
            if re.search(r"Error|Exception", bases) and path.name != "errors.py":
                found.append(f"{path.relative_to(root)}: {name}({bases})")
    assert not found, found


def test_every_flashplan_error_is_raised_with_a_field_and_a_message() -> None:
    """Each construction of a flashplan error in the package passes the field and the
    message (``Error(field, message, request=..., **values)``), never one free string."""
    import ast
    from pathlib import Path

    classes = {
        name
        for name in errors.__all__
        if isinstance(getattr(errors, name), type)
        and issubclass(getattr(errors, name), FlashplanError)
    }
    root = Path(fp.__file__).parent
    bad = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", None))
                if name in classes and len(node.args) < 2 and path.name != "errors.py":
                    bad.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    assert not bad, bad
