"""Part 4, DistributedDataParallel from scratch (chapter 7).

:mod:`.ddp` builds DDP in four steps, :mod:`.buckets` is its reducer (``Bucket``,
``BucketManager``), :mod:`.checks` what DDP checks before it starts, :mod:`.sampler`
``DistributedSampler``'s order, :mod:`.timeline` the reducer's timings for the bucket timeline.

Chapter 7: DistributedDataParallel.
"""
