"""How a failed collective surfaces, for every process group loomrl makes (the trainer ranks' default group,
train_pool/distributed.py init_process_group; the weight broadcast's, weights/group.py WeightGroup).

gloo raises in the calling thread when a peer dies or a collective passes its timeout. NCCL does not: its collectives
are queued on a CUDA stream, and a watchdog thread notices the timeout. What the watchdog then does is
TORCH_NCCL_ASYNC_ERROR_HANDLING's: torch's default (3) tears the whole process down with the watchdog's dump, after
the timeout, so a dead rank or an engine that never joins the broadcast ends the run as a crash of the survivors,
after minutes, saying only that a work item timed out. loomrl sets 2 unless the user set it: the watchdog aborts the NCCL communicator (which also ends the kernels waiting
on it) and leaves the process alone. The failure then shows where loomrl looks for it: the trainer's next collective
on the aborted communicator raises a DistBackendError (RankLost: one line, restart from the checkpoint). The weight
group does not wait for the watchdog at all: its own timeout is set past loomrl's per-bucket deadline, and a bucket
that misses the deadline aborts the group and raises at that end (weights/group.py), because a work the watchdog
aborted reads as completed without an error. Every group is made with a timeout (train_pool/ranks.py
COLLECTIVE_TIMEOUT_S; the broadcast's runtime timeout), so both ends are bounded. An SGLang server makes its end of the
weight group with its own settings: a trainer that dies mid-version may take that server down rather than raise
there.

The variable is read when a ProcessGroupNCCL is constructed (c10d ProcessGroupNCCL.cpp), so it is set just before
each group is made, in the process that makes it (vLLM's workers too: WeightGroup runs there).
"""

from __future__ import annotations

import os

ERROR_HANDLING_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
ABORT_COMMUNICATOR_ONLY = "2"  # abort the communicator, raise in the caller; never tear the process down


def bounded_nccl() -> None:
    """Make NCCL groups made from now on in this process raise on a timeout or a dead peer (see above); a value the
    user set is kept."""
    os.environ.setdefault(ERROR_HANDLING_VAR, ABORT_COMMUNICATOR_ONLY)


def collective_failed(err: BaseException) -> bool:
    """Whether a torch.distributed call failed because of the process group (a peer that died or timed out), as
    opposed to this rank's own error. NCCL's surface as DistError (DistBackendError); gloo's as plain RuntimeErrors."""
    import torch.distributed as dist

    text = str(err).lower()
    return isinstance(err, dist.DistError) or "gloo" in text or "nccl" in text
