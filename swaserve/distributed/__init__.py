"""Scale-out (docs/architecture.md, scale-out): tensor parallelism.

    parallel_state.py  the process groups of this process and their collectives (one home)
    sharding.py        which part of a full tensor a rank holds; checkpoint tensors into it
    layers.py          the model's sharded layers, swapped in at build time (`shard_model`)
    step_wire.py       what rank 0 tells the other ranks each step, as int64 tensors
    tp_runner.py       rank 0's ModelRunner: announces every forward, logits and page copy
    worker.py          ranks 1..T-1: their shard of the model and KV pool, a loop mirroring rank 0
    launch.py          starting the workers from rank 0, watching them, stopping them
    nccl_guard.py      NCCL_GRAPH_REGISTER when a captured CUDA graph may hold a collective

With `tensor_parallel_size` 1 none of this is imported: a single process runs as before.
"""
