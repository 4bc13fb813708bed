"""What every Ray actor of a run shares: where it runs, and how its errors read. Plain classes elsewhere
(rollout/actor.py, rollout/reward_actor.py, env/remote.py, train_pool/actor.py); the Ray backend
(runtime/ray_backend.py) wraps them with `ray.remote`, so that importing them needs no ray."""

from __future__ import annotations

import os

from loomrl.errors import error_line, named_line


def constructor_failed(err: BaseException) -> bool:
    """Whether a Ray actor error says the actor's constructor raised (every fresh one would too)."""
    return "creation task" in str(err)


def actor_error_line(err: BaseException) -> str:
    """The message of the exception an actor raised (Ray wraps it in a traceback)."""
    import ray.exceptions

    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
        err = err.cause
    return error_line(err, end=True)


def failure_line(err: BaseException) -> str:
    """The cause of an actor's failure in one line, without Ray's header (`ray::Class.method() (pid=..., ip=...)`, which
    names where it ran, not what went wrong): the exception a method raised, or the last line of a constructor's
    traceback; Ray's own first line for anything else (an actor killed, its node lost)."""
    if constructor_failed(err):
        return error_line(err, end=True)
    import ray.exceptions

    if isinstance(err, ray.exceptions.RayTaskError) and err.cause is not None:
        return named_line(err.cause)
    return error_line(err)


class Placed:
    """An actor that can say where the scheduler placed it."""

    def where(self) -> tuple[str, int]:
        """(Ray node id, process id)."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this actor (its CUDA_VISIBLE_DEVICES; a fraction of one is that one), each as
        "node/index": an index names a GPU only within its node."""
        import ray

        node = ray.get_runtime_context().get_node_id()
        return [f"{node}/{g}" for g in ray.get_gpu_ids()]
