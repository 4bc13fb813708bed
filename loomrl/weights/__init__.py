"""Weights: versioned transfer of the trained weights from the trainer to the inference engines.

A publisher snapshots a dict of tensors under a version and returns a `WeightHandle`: a small
picklable record that travels to the engines by whatever channel the runtime already has (a queue,
a Ray actor call); `load_weights(handle)` turns it back into tensors there. Transports:

- "queue": the tensors ride inside the handle (cloned at publish). Sending the handle through a
  multiprocessing queue is today's async path: torch's pickler moves each storage into shared
  memory on the way. The baseline; the handle is as large as the model.
- "shm":  POSIX shared-memory segments holding a header (tensor names, dtypes, shapes, offsets and the version) then the
  tensors' bytes, 64-byte aligned. The handle names the segment. Segments of versions out of the window are rewritten
  for later ones (a new segment costs several times the copy: the kernel allocates and zeroes every page), under flock
  so that no reader is mid-copy (see the section's comment).
- "file": a folder per version holding a safetensors file per bucket (each naming the version and the bucket count,
  so a reader that finds files missing knows the version is being freed), written under a temporary name, fsynced,
  then renamed into place (os.replace is atomic). Works across machines on a shared filesystem.
- "cuda_ipc": the snapshot stays on the trainer's GPU, cast to the engine's dtype, and the handle carries a CUDA IPC
  handle per tensor (torch's reduce_tensor: vLLM's "ipc" layout, names / dtype_names / shapes / ipc_handles keyed by
  the GPU's UUID), so an engine process on the same GPU maps the tensors without a host round trip. The vLLM engine
  hands them to its worker (engine/vllm/worker.py); `load_weights` rebuilds them for any other engine. CUDA only.
- "broadcast": the trainer broadcasts each version over a process group of its own with the engine's workers
  (group.py: NCCL between GPUs, gloo on CPUs); the handle carries the group's address and the
  version's names, dtypes and shapes, and the engine's workers receive it (engine.kind=vllm in process, or sglang). Nothing is held:
  the broadcast reads the live parameters, so the trainer settles it (`settle`) before its next step.
- "ray":  no publisher here. The Ray backend (runtime/ray_backend.py publish) puts in the handle's payload the ObjectRef
  of the weights the trainer actor returned with its step (an object in Ray's store, owned by the driver, never
  rewritten, freed by Ray's reference counting); rollout actors await it (rollout/actor.py update_weights) instead of
  calling `load_weights`.

Atomicity (a reader never sees a mix of two versions): every transport writes a version completely before its handle
exists and never writes over a version while it can be read: files are never rewritten; a shm segment is rewritten only
under an exclusive flock that readers hold shared while they copy, and a reader checks the segment's header names its
handle's version. Cleanup: the publisher keeps the last `keep` versions loadable (default 2: the current one and the one
engines may still be loading); older ones are unlinked (file, shm beyond one spare segment). On POSIX, unlinking only
removes the name: a reader that has a file or segment open finishes normally; one that comes later (or finds its
segment rewritten) gets `StaleWeights` and should load the newer handle, which is already on its way (handles are
published in version order). Segments are also unlinked when the publisher closes, and by Python's resource tracker if
the publisher's process dies.

Devices, dtypes and buckets: a publisher reads a version from a `WeightSource` (source.py) a bucket at a time, already
cast to the engine's dtype on the trainer's device (the publisher's `dtype`; a dict given to `publish` is cast so as it
is read; a sharded trainer's source gathers each bucket from every rank, train_pool/distributed.py GatheredSource). What a
transport keeps is its own copy in that dtype: the shm segment (each bucket copied device to host into its place), the
file's folder (a file per bucket), the queue's handle, the GPU snapshot of cuda_ipc; broadcast keeps nothing and sends
each bucket from the trainer's device (NCCL on GPUs). No transport builds a whole-model copy in the trainer's float32.
The engine still casts to its model's dtype and device as it loads (a no-op when the dtypes agree).

Confirmation (fingerprint.py): the publisher checksums a few tensors of each version as its buckets pass and puts the
`Fingerprint` in the handle; the engine, once it has applied the version, checksums its own copies of them, and a
mismatch stops the run (`WeightMismatch`, naming the engine, the version and the tensors).

The package: `handle.py` (the records and the publisher's base), `source.py` (what a version is read from, the bucket
plan), `fingerprint.py` (the checksum a version is confirmed by), one module per transport (`queue.py`, `shm.py`,
`file.py`, `ipc.py`, `broadcast.py` over `group.py`), `transports.py` (`make_publisher`, `load_weights`) and `route.py`
(what a run's config asks of the route: the engine's dtype, the receivers of a broadcast). The trainer and the engines
both import it; it imports neither.

What this package is not: a channel (handles are sent by the caller) or a policy for when engines
apply weights (engine.update_weights does that). One publisher per process and per folder; publish
is not meant to be called from two threads at once.
"""
