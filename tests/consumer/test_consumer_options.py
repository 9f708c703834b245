"""ConsumerOptions: RemoteDataZMQ's rarely set settings in one frozen value.

Claims: a setting that can never work is a one-line ConfigError when the options are made
(the messages RemoteDataZMQ gave before); the keywords of the previous release
(``RemoteDataZMQ(addr, window=2)``) still work, with one DeprecationWarning at the caller's
line that spells the new form, and do what the options do against a real broker; a
keyword that is no option, or one given with ``options=`` too, is a one-line TypeError.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

import feedline
from feedline.consumer import ConsumerOptions, RemoteDataZMQ
from feedline.consumer.direct import DirectConfig
from feedline.errors import ConfigError
from feedline.producer import send_dataflow
from feedline.protocol.codec import Limits
from feedline.transport.link import LinkConfig

FAST = LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.5)
NOWHERE = "ipc:///tmp/feedline-options-test-nobody.sock"  # never connected: no iteration


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"window": 0}, "window must be in 1..4096"),
    ({"window": 4097}, "window must be in 1..4096"),
    ({"window": 9, "link": LinkConfig(limits=Limits(max_window=8))}, "window must be in 1..8"),
    ({"on_error": "ignore"}, "on_error must be 'raise' or 'log'"),
    ({"max_bytes": 0}, "max_bytes must be >= 1"),
    # The attack review: these were accepted, or failed later with a bare TypeError or
    # AttributeError.
    ({"window": 2.5}, "ConsumerOptions: window must be a count of batches, not float 2.5"),
    ({"window": True}, "ConsumerOptions: window must be a count of batches, not bool True"),
    ({"window": "8"}, "ConsumerOptions: window must be a count of batches, not str '8'"),
    ({"max_bytes": "1G"}, "ConsumerOptions: max_bytes must be a count of bytes, not str '1G'"),
    ({"insecure": "no"}, "ConsumerOptions: insecure must be True or False, not str 'no'"),
    ({"link": None}, "ConsumerOptions: link must be a LinkConfig, not NoneType None"),
    ({"consumer_id": 5}, "ConsumerOptions: consumer_id must be a string, not int"),
    ({"registry": "x"}, "ConsumerOptions: registry must be a prometheus_client "
                        "CollectorRegistry, not str"),
])
def test_a_setting_that_cannot_work_is_one_line_when_the_options_are_made(kwargs, message):
    with pytest.raises(ConfigError) as err:
        ConsumerOptions(**kwargs)
    assert str(err.value) == message
    assert isinstance(err.value, ValueError)  # what code written before ConfigError catches


def test_the_defaults_are_the_old_keywords_defaults_and_the_value_is_frozen():
    o = ConsumerOptions()
    assert (o.window, o.max_bytes, o.consumer_id, o.on_error, o.registry, o.insecure) == \
        (4, 1 << 30, None, "raise", None, False)
    assert o.link == LinkConfig() and o.direct == DirectConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.window = 8  # type: ignore[misc]
    assert feedline.ConsumerOptions is ConsumerOptions and "ConsumerOptions" in feedline.__all__
    with RemoteDataZMQ(NOWHERE) as remote:
        assert remote.options == o and remote.config.window == 4


def test_an_old_keyword_warns_once_at_the_callers_line_and_sets_the_same_options():
    registry = CollectorRegistry()
    with pytest.warns(DeprecationWarning) as record:
        old = RemoteDataZMQ(NOWHERE, timeout=5, window=8, registry=registry, link=FAST)
    old.close()
    assert len(record) == 1
    (w,) = record
    assert w.filename == __file__, w.filename  # the call above, not feedline's code
    assert str(w.message) == (
        "RemoteDataZMQ(window=..., registry=..., link=...) is deprecated (it goes in the next "
        "release): write RemoteDataZMQ(addr, options=ConsumerOptions(window=..., "
        "registry=..., link=...))")
    assert old.options == ConsumerOptions(window=8, registry=registry, link=FAST)
    # None meant "the default" for these three, and still does
    with pytest.warns(DeprecationWarning):
        RemoteDataZMQ(NOWHERE, max_bytes=None, link=None, direct=None).close()
    # an old keyword's bad value: the same one-line ConfigError as before
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match=r"^window must"):
        RemoteDataZMQ(NOWHERE, window=0)


def test_the_new_spelling_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RemoteDataZMQ(NOWHERE, timeout=5, options=ConsumerOptions(window=8)).close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"windw": 8}, "RemoteDataZMQ() got an unexpected keyword argument 'windw'"),
    ({"window": 8, "options": ConsumerOptions()},
     "RemoteDataZMQ: window=... cannot go with options=; set it there: "
     "options=ConsumerOptions(window=...)"),
    ({"options": LinkConfig()}, "RemoteDataZMQ: options= takes a ConsumerOptions, not LinkConfig"),
])
def test_a_keyword_that_is_no_option_or_given_twice_is_a_one_line_type_error(kwargs, message):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any warning
        with pytest.raises(TypeError) as err:
            RemoteDataZMQ(NOWHERE, **kwargs)
    assert str(err.value) == message


def _numbered() -> list[list[np.ndarray]]:
    return [[np.full((8, 4), i, np.float32)] for i in range(50)]


def test_old_keywords_and_options_do_the_same_against_a_broker(thread_broker, endpoints,
                                                              caplog):
    """Two consumers of one live broker, one per spelling, with the same window, a consumer
    id and a registry each: the broker knows each by its id, each registry counts what its
    consumer received, and both registered the same window and budget."""
    caplog.set_level(logging.INFO, logger="feedline.broker")
    thread_broker()
    stop = threading.Event()
    sender = threading.Thread(target=send_dataflow, args=(_numbered(), endpoints.ingress),
                              kwargs={"producer_id": "p", "link": FAST, "stop": stop},
                              daemon=True)
    sender.start()
    reg_old, reg_new = CollectorRegistry(), CollectorRegistry()
    with pytest.warns(DeprecationWarning, match=r"options=ConsumerOptions\(window=\.\.\."):
        old = RemoteDataZMQ(endpoints.egress, timeout=30, return_meta=True, window=2,
                            consumer_id="old-spelling", registry=reg_old, link=FAST)
    new = RemoteDataZMQ(endpoints.egress, timeout=30, return_meta=True,
                        options=ConsumerOptions(window=2, consumer_id="new-spelling",
                                                registry=reg_new, link=FAST))
    try:
        assert old.options == dataclasses.replace(new.options, consumer_id="old-spelling",
                                                  registry=reg_old)
        assert old.config == new.config  # what each registers: window, budget, stream
        its = {"old": iter(old), "new": iter(new)}
        got: dict[str, list] = {"old": [], "new": []}
        for _ in range(10):  # one from each, in turn
            for name, it in its.items():
                got[name].append(next(it))
    finally:
        old.close()
        new.close()
        stop.set()
        sender.join(10)
    for name, reg in (("old", reg_old), ("new", reg_new)):
        assert len(got[name]) == 10 and {b.producer for b in got[name]} == {"p"}
        received = reg.get_sample_value("feedline_consumer_received_batches_total")
        assert received is not None and received >= 10, (name, received)
    # No batch twice across the two (the broker shares one stream between them).
    seen = [(b.producer, b.seq) for b in got["old"] + got["new"]]
    assert len(set(seen)) == len(seen), seen
    joined = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert any("old-spelling" in m for m in joined) and any("new-spelling" in m for m in joined)


def test_an_address_timeout_or_liveness_that_cannot_work_is_one_line() -> None:
    """The attack review: ``RemoteDataZMQ(5)`` raised an AttributeError, ``timeout=-1`` and
    ``timeout='5'`` were taken, and a heartbeat interval past its timeout (every live peer
    dropped) was accepted."""
    with pytest.raises(ConfigError, match="the address must be a string"):
        RemoteDataZMQ(5)  # type: ignore[arg-type]
    for t in (-1, 0, "5", True):
        with pytest.raises(ConfigError, match="timeout must be a number of seconds > 0"):
            RemoteDataZMQ(NOWHERE, timeout=t)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be > 0 and below heartbeat_timeout"):
        LinkConfig(heartbeat_interval=5, heartbeat_timeout=1)

