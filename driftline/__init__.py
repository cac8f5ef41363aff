"""The ``driftline`` command and what it runs on one machine: the CLI, ``up``, the supervisor and
the embedded broker and Redis.

The services' shared plumbing (settings, Kafka, codecs, metrics, logs) lives in :mod:`services`,
which imports nothing from here or from the services themselves.
"""
