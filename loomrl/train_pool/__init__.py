"""The training pool's plumbing around the step (loomrl/trainer/ is the step's math): TrainerService (buffer,
selection, the trainer, ledger, checkpoints), its process and its Ray actors, data-parallel ranks, offloading beside a
colocated engine, and pushing each version to it."""
