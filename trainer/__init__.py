"""driftline online trainer: models over PS embedding tables, batch and streaming training.

Public API (what serving imports):

* :class:`trainer.config.ModelConfig` - a model declared as data (slots -> tables, MLP, ...).
* :class:`trainer.batch.SparseBatch` - a batch of examples as flat ids + offsets per slot.
* :class:`trainer.inference.Scorer` - ``Scorer(config, tables, dense_state).predict(batch)``.
* :mod:`trainer.sync` - ParameterDelta encode/decode (``decode_sparse``, ``decode_dense``, ...).
* :func:`trainer.snapshots.load_latest` - ``(tables, dense_state, manifest)`` for catch-up (the
  manifest a :class:`trainer.manifest.Manifest`).
"""

import os as _os
import sys as _sys

# torch's CPU build runs intra-op work on libgomp threads that, by default, spin at every barrier.
# With 2 threads on 2 cores shared with anything else (the decoding thread, the broker, other jobs)
# a spinning thread holds a core the straggler needs: measured DeepFM steps 2-40x slower (3k-80k
# ex/s instead of ~150k). Passive waiting costs ~5% when the machine is idle and removes the
# collapse. libgomp reads this once, when torch loads it, so it only helps if torch is not imported
# yet (``python -m trainer`` and the bench import ``trainer`` first).
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
