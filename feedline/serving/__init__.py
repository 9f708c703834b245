"""The serving core: what the broker and a direct-mode trainer both run to serve producers.

:class:`feedline.serving.server.Server` puts it together for a host: its endpoints
(:mod:`feedline.serving.endpoint`: bind, drain, refusals, cut-offs), the producer side
(:mod:`feedline.serving.producers`: registrations, credit from
:mod:`feedline.serving.credit` within one :class:`feedline.serving.budget.Budget`, batches),
the peer tables (:mod:`feedline.serving.peers`), exact delivery's coordinator
(:mod:`feedline.exact.coordinator`), tensorpack's ingress and the metrics they count in.
The hosts (:mod:`feedline.broker.core`, :mod:`feedline.consumer.direct`) add only where
accepted batches go and who runs the loop.
"""
