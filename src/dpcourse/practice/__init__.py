"""Part 5, training at scale in practice: learning-rate scaling, mixed precision, SyncBatchNorm,
checkpoints, and the command-line trainer that puts chapters 1-9 together (:mod:`.train`).

Chapter 8: training at scale in practice.
"""
