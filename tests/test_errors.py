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


# -- the FlashInfer executor's constructors on a machine without CUDA (issue 50, item 5) ---

#: How a user names "the GPU" when constructing an executor.
CUDA_DEVICES = [None, "cuda", "cuda:0", torch.device("cuda"), torch.device("cuda", 0), 0]

#: The public ways to construct a FlashInfer executor (flashplan and its flashinfer package).
EXECUTOR_CONSTRUCTORS = {
    "FlashInferExecutor": lambda device: fp.FlashInferExecutor(device),
    "FlashInferExecutor, bad options": lambda device: fp.FlashInferExecutor(
        device, policy="fast", workspace_bytes=1, check_pages="yes"
    ),
    "graph_executor": lambda device: fp.graph_executor(
        fp.FlashInferExecutor(device), fp.GraphBucket.decode(batch_size=8, max_pages=4)
    ),
    "for_bucket": lambda device: fp.FlashInferExecutor(device).for_bucket(
        fp.GraphBucket.extend(batch_size=2, max_pages=4, tokens_per_request=3)
    ),
}


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees no CUDA (the CPU CI machine's case, forced on a GPU machine)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.usefixtures("no_cuda")
@pytest.mark.parametrize("device", CUDA_DEVICES, ids=repr)
@pytest.mark.parametrize("make", EXECUTOR_CONSTRUCTORS.values(), ids=EXECUTOR_CONSTRUCTORS.keys())
def test_an_executor_without_cuda_is_an_unsupported_error_saying_so(
    make: object, device: object
) -> None:
    """Without CUDA every public constructor raises the documented
    :class:`~flashplan.UnsupportedError` naming ``device`` and saying CUDA is missing,
    before any option check; never torch's bare ``AssertionError`` ("Torch not compiled
    with CUDA enabled"), which the default device's lookup raised first."""
    assert callable(make)
    with pytest.raises(fp.UnsupportedError) as err:
        make(device)
    assert err.value.field == "device"
    assert "needs CUDA, which is not available here" in str(err.value)


@pytest.mark.usefixtures("no_cuda")
def test_the_graph_helpers_refuse_a_non_executor_with_their_documented_error() -> None:
    """Without CUDA no executor exists: ``graph_executor`` and ``capture`` given something
    else raise their documented :class:`~flashplan.PlanMismatchError`, and the buckets
    (pure) are made as on a GPU machine."""
    import flashplan.executor.flashinfer as fi

    bucket = fi.GraphBucket.verify(batch_size=2, max_pages=3, num_tokens=4)
    assert bucket.total_q == 8
    for field, call in (
        ("parent", lambda: fi.graph_executor("executor", bucket)),  # type: ignore[arg-type]
        ("executor", lambda: fi.capture("executor", lambda: None)),  # type: ignore[arg-type]
    ):
        with pytest.raises(fp.PlanMismatchError, match=r"FlashInferExecutor|for_bucket") as err:
            call()
        assert err.value.field == field


def test_a_cuda_index_this_machine_lacks_is_an_unsupported_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cuda:3`` on a one-GPU machine is refused naming the device and the count, before
    the workspace allocation (a RuntimeError) or torch's device-properties lookup (a bare
    ``AssertionError("Invalid device id")``)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(fp.UnsupportedError, match=r"no such CUDA device: this machine has 1"):
        fp.FlashInferExecutor("cuda:3")


def test_the_executor_constructors_check_arguments_without_assert() -> None:
    """Argument checks of the executor constructors are raises, never ``assert``
    (which ``python -O`` removes)."""
    import ast
    import textwrap
    from collections.abc import Callable

    from flashplan.executor.flashinfer import bucket, executor, graphs

    functions: list[Callable[..., object]] = [
        executor.FlashInferExecutor.__init__,
        executor.FlashInferExecutor.for_bucket,
        executor._device,
        graphs.graph_executor,
        bucket.GraphBucket.__attrs_post_init__,
        bucket.GraphBucket.decode,
        bucket.GraphBucket.extend,
        bucket.GraphBucket.verify,
    ]
    found = [
        f"{f.__qualname__}:{node.lineno}"
        for f in functions
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(f))))
        if isinstance(node, ast.Assert)
    ]
    assert not found, found


def test_errors_are_also_the_builtins_python_users_expect() -> None:
    """Issue 53, item 4: a wrong argument type is a flashplan error and a TypeError; a
    missing device is a flashplan error and a RuntimeError (and still the documented
    UnsupportedError)."""
    assert issubclass(fp.RunTypeError, fp.PlanMismatchError)
    assert issubclass(fp.RunTypeError, TypeError)
    assert issubclass(fp.DeviceUnavailableError, fp.UnsupportedError)
    assert issubclass(fp.DeviceUnavailableError, RuntimeError)
    ex = fp.ReferenceExecutor()
    with pytest.raises(TypeError) as err:
        ex.apply("not a plan", None)  # type: ignore[arg-type]
    assert isinstance(err.value, fp.RunTypeError) and err.value.field == "spec"
    layout = fp.BatchLayout.decode([3, 5])
    heads = fp.HeadConfig(2, 1, 8, q_dtype=torch.float32)
    spec = fp.plan(layout, heads)
    ex.apply(spec, fp.PageTable.sequential(spec.pages_needed))
    with pytest.raises(TypeError) as err:
        ex.run(layout.groups[0], [[0.0]], None, None, None)  # type: ignore[arg-type]
    assert err.value.field == "q"
    if not torch.cuda.is_available():
        from flashplan.executor.flashinfer import FlashInferExecutor

        with pytest.raises(RuntimeError) as err:
            FlashInferExecutor()
        assert isinstance(err.value, fp.DeviceUnavailableError)
