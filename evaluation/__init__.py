"""Reproductions of the Monolith paper's experiments on ml-1m: ``driftline eval ...``.

Every experiment drives the real system, never a separate toy: models are
:class:`trainer.model.SparseModel` over :class:`ps.EmbeddingTable` s built from
:func:`trainer.config.deepfm_config`; batches come from :class:`trainer.data.MovieLensData`;
serving is a :class:`trainer.inference.Scorer` kept fresh through the real
``ParameterDelta`` path (:func:`trainer.sync.encode_sparse_tables` -> bytes ->
:func:`trainer.sync.apply_delta`, :func:`trainer.sync.encode_dense` -> bytes ->
:func:`trainer.sync.decode_dense`); fault tolerance restores :mod:`trainer.snapshots`.

* :mod:`evaluation.collisions` - collisionless vs MD5-hashed ids (paper Figure 7);
* :mod:`evaluation.online` - Algorithm 1, sync interval N = 10/50/100 vs batch-only (Figures 9/10,
  Table 2) and the stale-snapshot restore (fault tolerance);
* :mod:`evaluation.baselines` - River and a fixed-size hashed ``nn.Embedding`` DeepFM on the same
  stream as driftline's online DeepFM;
* :mod:`evaluation.report` - ``docs/results.json``, ``docs/results.md`` and the plots;
* :mod:`evaluation.cli` - ``main(argv)``, the ``driftline eval`` command.
"""

import trainer as _trainer  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads)
