"""One error root (issue 23, part 4): every error feedline raises is a FeedlineError, keeps the
builtin base callers catch, and a protocol refusal has its own type with its reason.

The first two tests read the package itself (every module, the C extension included), so
they stay true as modules are added: a new exception class that is not a FeedlineError, or a
``raise ValueError(...)`` in product code, fails them with the file and line."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import zmq

from feedline import errors
from feedline.errors import FeedlineError
from feedline.procs import wait_for
from feedline.protocol import messages as m
from tests.support.flow_support import start_broker
from tests.support.hand_protocol import RawPeer, consumer_hello
from tests.support.package_source import modules

# Builtin errors product code may still raise: a programming error in the caller (an
# argument of the wrong type), an abstract method, a module's __getattr__, iteration and
# exit protocols. Everything else is a FeedlineError (see feedline/errors.py).
ALLOWED_BUILTINS = {"TypeError", "NotImplementedError", "AttributeError", "StopIteration",
                    "SystemExit", "KeyboardInterrupt"}
BUILTIN_ERRORS = {n for n, v in vars(builtins).items()
                  if isinstance(v, type) and issubclass(v, BaseException)}


def _importable() -> tuple[list[ModuleType], list[str]]:
    """The package's modules imported (``__main__`` modules run when imported: not those),
    the C extension included when built; and the names of those that need an optional
    library this environment lacks (their classes are checked from source instead)."""
    loaded, missing = [], []
    for mod in modules():
        if mod.name.endswith("__main__"):
            missing.append(mod.name)
            continue
        try:
            loaded.append(importlib.import_module(mod.name))
        except ModuleNotFoundError as e:  # torch, tensorflow: extras
            assert e.name and not e.name.startswith("feedline"), e
            missing.append(mod.name)
    from feedline.producer.image import turbo
    if turbo.AVAILABLE:
        loaded.append(importlib.import_module("feedline.producer.image._jpegturbo"))
    return loaded, missing


def test_every_exception_class_of_the_package_is_a_feedline_error() -> None:
    """Claim: every exception class any module of the package defines (the C extension's
    too) is a FeedlineError; in a module that cannot be imported here (an extra is missing),
    no class derives from a builtin exception directly."""
    loaded, missing = _importable()
    bad = []
    for module in loaded:
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__
                    and not issubclass(obj, FeedlineError)):
                bad.append(f"{module.__name__}.{name} {[c.__name__ for c in obj.__mro__]}")
    for mod in modules():
        if mod.name not in missing:
            continue
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ClassDef):
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                if bases & BUILTIN_ERRORS and "FeedlineError" not in bases:
                    bad.append(f"{mod.rel}:{node.lineno} class {node.name}"
                               f"({', '.join(sorted(bases))})")
    assert len(loaded) > 80, [m.__name__ for m in loaded]
    assert not bad, ("not FeedlineErrors (derive from a class of feedline/errors.py; "
                     "after a change to the C extension, rebuild it: python3 setup.py "
                     "build_ext --inplace):\n" + "\n".join(bad))


def test_no_product_module_raises_a_builtin_error() -> None:
    """Claim: no module of the package raises a builtin error beyond the programming-error
    ones (``raise ValueError(...)`` is ``raise ConfigError(...)`` or ``DataError``...)."""
    bad = []
    for mod in modules():
        for node in ast.walk(mod.tree):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if (isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS
                    and exc.id not in ALLOWED_BUILTINS):
                bad.append(f"{mod.rel}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert not bad, "builtin errors raised (use feedline/errors.py's):\n" + "\n".join(bad)


@pytest.mark.parametrize("cls, bases", [
    (errors.DecodeError, (errors.Refusal, ValueError)),
    (errors.EncodeError, (TypeError,)),
    (errors.ConfigError, (ValueError,)),
    (errors.AddressError, (errors.ConfigError,)),
    (errors.KeyFileError, (errors.ConfigError,)),
    (errors.DataError, (ValueError,)),
    (errors.DataNotFound, (errors.DataError, FileNotFoundError)),
    (errors.OutputExists, (FileExistsError,)),
    (errors.CorruptImage, (errors.SampleError,)),
    (errors.WorkerError, (RuntimeError,)),
    (errors.CurveUnavailable, (errors.Unavailable, RuntimeError)),
    (errors.UsageError, (RuntimeError,)),
    (errors.ReceiveTimeout, (errors.Timeout, TimeoutError)),
])
def test_each_error_keeps_the_builtin_base_callers_catch(cls: type, bases: tuple) -> None:
    assert issubclass(cls, FeedlineError) and all(issubclass(cls, b) for b in bases)


def test_a_refusal_is_not_necessarily_a_decoding_error() -> None:
    """Claim: hosts catch Refusal and so count decoding errors too; a refusal of a well-formed
    message (not_exact, wrong_stream, beyond credit) is not a DecodeError, nor a ValueError."""
    e = errors.Refusal("not_exact", "UnitRequest on stream train")
    assert e.reason == "not_exact" and str(e) == "not_exact: UnitRequest on stream train"
    assert not isinstance(e, (errors.DecodeError, ValueError))
    assert isinstance(errors.DecodeError("bad_dtype"), errors.Refusal)


def test_the_old_import_paths_name_the_same_classes() -> None:
    """Claim: code that imported an error from where it used to be defined gets the class
    of feedline/errors.py (one class, so ``except`` either way catches it)."""
    from feedline import endpoints, security
    from feedline.producer import channel, pipeline, pipeline_spec
    from feedline.producer.dataflow import errors as df_errors
    from feedline.protocol import codec, wire
    decode = importlib.import_module("feedline.producer.image.decode")
    pairs = [(codec.DecodeError, errors.DecodeError), (wire.DecodeError, errors.DecodeError),
             (codec.EncodeError, errors.EncodeError), (security.KeyFileError,
             errors.KeyFileError), (security.CurveUnavailable, errors.CurveUnavailable),
             (endpoints.AddressError, errors.AddressError), (pipeline_spec.ConfigError,
             errors.ConfigError), (pipeline.ConfigError, errors.ConfigError),
             (df_errors.SampleError, errors.SampleError), (df_errors.WorkerError,
             errors.WorkerError), (decode.CorruptImage, errors.CorruptImage),
             (channel.BatchTooLarge, errors.BatchTooLarge)]
    assert [a is b for a, b in pairs] == [True] * len(pairs)


def _missing_lmdb(tmp: Path) -> None:
    from feedline.producer.dataflow import LMDBData
    LMDBData(tmp / "nothing.lmdb")


def _empty_folder(tmp: Path) -> None:
    from feedline.producer.dataflow import ImageFolder
    (tmp / "cats").mkdir()
    ImageFolder(tmp)


def _zero_batch(tmp: Path) -> None:
    from feedline.producer.dataflow import BatchData, DataFromList
    BatchData(DataFromList([1, 2]), 0)


def _second_pass(tmp: Path) -> None:
    from feedline.producer.dataflow import DataFromGenerator
    df = DataFromGenerator(iter([1, 2]))
    df.reset_state()
    list(df)
    list(df)


def _bad_cursor(tmp: Path) -> None:
    from feedline.exact.cursor import Cursor
    Cursor.decode(b"FLC1")


def _not_a_jpeg(tmp: Path) -> None:
    from feedline.producer.image.decode import decode
    decode(b"not an image at all")


@pytest.mark.parametrize("fail, cls, builtin", [
    (_missing_lmdb, errors.DataNotFound, FileNotFoundError),
    (_empty_folder, errors.DataError, ValueError),
    (_zero_batch, errors.ConfigError, ValueError),
    (_second_pass, errors.UsageError, RuntimeError),
    (_bad_cursor, errors.DecodeError, ValueError),
    (_not_a_jpeg, errors.CorruptImage, Exception),
], ids=lambda v: getattr(v, "__name__", ""))
def test_what_a_user_meets_is_caught_by_feedline_error(
        tmp_path: Path, fail: Callable[[Path], None], cls: type, builtin: type) -> None:
    """Claim: real failures (a missing LMDB file, an empty image folder, a bad argument, a
    one-pass source read twice, a corrupt cursor, bytes that are not an image) raise the
    documented class, which both ``except FeedlineError`` and the old builtin catch."""
    with pytest.raises(cls) as info:
        fail(tmp_path)
    assert isinstance(info.value, FeedlineError) and isinstance(info.value, builtin)
    assert str(info.value), "a message that says what is wrong"


def test_the_broker_counts_refusals_and_decoding_errors_under_their_reasons(
        broker_proc, endpoints) -> None:
    """Claim: a real broker counts a refusal of a well-formed message (a consumer's HELLO on
    the producers' port: ``wrong_port``, a Refusal) and a message that does not decode
    (``bad_msgpack``, a DecodeError) under their reasons, as the metrics always named them,
    and answers the misplaced consumer with REFUSED."""
    _, metrics = start_broker(broker_proc)
    ctx = zmq.Context()
    peer = RawPeer(ctx, endpoints.ingress)
    try:
        peer.sock.send(consumer_hello("lost-consumer", 4))
        assert peer.sock.poll(10_000), "no answer to a HELLO on the wrong port"
        answer = m.decode(peer.sock.recv_multipart()[0])
        peer.sock.send(b"\xc1 not msgpack")

        def counted() -> dict[str, float]:
            got = metrics.by_label("feedline_broker_rejected_messages_total", "reason")
            return got if {"wrong_port", "bad_msgpack"} <= set(got) else {}

        rejected = wait_for(counted, 10, what="both refusals counted")
    finally:
        peer.close()
        ctx.term()
    assert isinstance(answer, m.Refused) and answer.reason == "wrong_port", answer
    assert rejected == {"wrong_port": 1.0, "bad_msgpack": 1.0}, rejected
