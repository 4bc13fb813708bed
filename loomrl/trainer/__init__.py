"""Policy optimisation: advantages, losses, the optimiser step, checkpoints."""
