"""Scale-out (docs/architecture.md, scale-out): tensor parallelism, expert parallelism.

    parallel_state.py  the process groups of this process and their collectives (one home)
    sharding.py        which part of a full tensor a rank holds; checkpoint tensors into it
    layers.py          the model's sharded layers, swapped in at build time (`shard_model`)
    step_wire.py       what rank 0 tells the other ranks each step, as int64 tensors
    tp_runner.py       rank 0's ModelRunner: announces every forward, logits and page copy
    worker.py          ranks 1..T-1: their shard of the model and KV pool, a loop mirroring rank 0
    launch.py          starting the workers from rank 0, watching them, stopping them
    nccl_guard.py      NCCL_GRAPH_REGISTER when a captured CUDA graph may hold a collective

Data-parallel attention + expert-parallel MoE (`--data-parallel-size D --enable-expert-parallel`):

    expert_shards.py    which experts a rank holds; the model cut to them at build time
    expert_parallel.py  the step agreement, the MoE exchange (dispatch/combine), idle forwards
    ep_launch.py        joining the group (server cores, offline ranks), naming a dead rank
    ep_wire.py          offline: rank 0's messages to the other ranks and their answers
    ep_worker.py        offline: ranks 1..D-1, each a whole EngineCore stepping on rank 0's word
    ep_engine.py        offline: the Engine's core over the D ranks (rank 0 in-process)
    ep_tp.py            -tp T inside each rank: the experts over D x T, the workers' groups
    (the server's lockstep core loop is swaserve/server/core_loop_ep.py, its ranks on other
    nodes swaserve/server/nodes.py)

Data parallelism without experts shared (`-dp D [-tp T]`) needs nothing here beyond TP: D
replicas, each its own TP group (swaserve/server/launch.py, swaserve/engine/replicas.py; over
nodes swaserve/server/nodes.py, as expert-parallel ranks).

With `tensor_parallel_size` 1 and no expert parallelism none of this is imported: a single
process runs as before.
"""
