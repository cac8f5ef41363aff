"""driftline online trainer: models over PS embedding tables, batch and streaming training.

Public API (what serving imports):

* :class:`trainer.config.ModelConfig` - a model declared as data (slots -> tables, MLP, ...).
* :class:`trainer.batch.SparseBatch` - a batch of examples as flat ids + offsets per slot.
* :class:`trainer.inference.Scorer` - ``Scorer(config, tables, dense_state).predict(batch)``.
* :mod:`trainer.sync` - ParameterDelta encode/decode (``decode_sparse``, ``decode_dense``, ...).
* :func:`trainer.snapshots.load_latest` - ``(tables, dense_state, manifest)`` for catch-up.
"""
