"""The serving core: what the broker and a direct-mode trainer both run to serve producers.

The producer side (:mod:`feedline.serving.producers`: registrations, credit from
:mod:`feedline.serving.credit`, batches, refusals, cut-offs), the peer tables
(:mod:`feedline.serving.peers`), exact delivery's coordinator
(:mod:`feedline.serving.coordinator`), tensorpack's ingress and the metrics they count in.
The hosts (:mod:`feedline.broker.core`, :mod:`feedline.consumer.direct`) add only where
accepted batches go.
"""
