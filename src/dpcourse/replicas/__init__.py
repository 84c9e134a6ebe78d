"""Part 2, replicas and averaging: one process driving copies of a model (chapters 2-4).

:mod:`.replication` and :mod:`.scatter_gather` build ``nn.DataParallel`` by hand (chapters 2-3),
:mod:`.dataparallel` measures torch's; :mod:`.averaging` averages gradients through a master copy,
:mod:`.parameter_averaging` averages weights instead (local SGD), :mod:`.replica_batchnorm` shows
what BatchNorm sees per replica (chapter 4).

Chapter 2: the idea of data parallelism (the folder serves chapters 2 to 4).
"""
