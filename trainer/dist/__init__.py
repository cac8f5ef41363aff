"""The online trainer as N ranks (``trainer online --nproc N``): the distributed engine.

* :mod:`trainer.dist.rank_trainer` - one rank's loop (lockstep rounds on :class:`trainer.loop.TrainerLoop`);
* :mod:`trainer.dist.model` - :class:`~trainer.dist.model.DistributedModel`, the step: sparse model
  parallel, dense data parallel; :mod:`trainer.dist.routing` (which rank owns a row, the wire
  order), :mod:`trainer.dist.owner` (the owner's side of a lookup), :mod:`trainer.dist.sequential`
  (the per-example kernels over shards);
* :mod:`trainer.dist.input` - a rank's partitions of ``examples``;
* :mod:`trainer.dist.rank_snapshots` - what a rank's snapshot records and where it resumes;
* :mod:`trainer.dist.launch` - torch's elastic launcher starting the ranks.
"""
