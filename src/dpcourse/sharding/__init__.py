"""Part 6, sharding: ZeRO and FSDP from scratch (chapter 9).

The flat buffer and its shards (:mod:`.flat_shards`), the sharded optimizer (:mod:`.zero`, with
:mod:`.zero_grads`, :mod:`.zero_join` and :mod:`.zero_state` for what torch's loops expect of it),
the memory per rank (:mod:`.zero_memory`), and FSDP (:mod:`.fsdp_layer`, :mod:`.fsdp`). Chapter
11 adds what sharding at scale uses: DeviceMesh and DTensor layouts (:mod:`.mesh`), a model
initialised on the meta device shard by shard (:mod:`.meta_init`) and hybrid sharding across
nodes (:mod:`.hsdp`).

Chapter 9: sharded optimizers and FSDP.
"""
