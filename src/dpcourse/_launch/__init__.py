"""The launcher's private plumbing, behind :mod:`dpcourse.launch` (whose API learners use).

``process``: the rank processes (starting, pipes, output, killing, stack dumps on a timeout);
``forkserver``: how one rank starts (forked from a server that has imported torch, or a fresh
interpreter); ``worker``: the program each rank runs (``serve``); ``errors``:
``RankError``, ``RankDiedError``, ``RankTimeoutError`` and how they read; ``torchrun``:
:func:`~dpcourse._launch.torchrun.run_torchrun`, a script or module under ``torchrun``.

Chapter 0: the course-wide runtime and launcher.
"""
