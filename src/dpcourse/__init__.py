"""Data Parallelism from Scratch: the package that every chapter of the course imports.

One module per concept (see ``DESIGN.md`` at the top of the repository): ``runtime`` and
``launch`` run code on N ranks; ``data``, ``models``, ``training`` and ``memory`` serve
chapter 1; later chapters add replication, averaging, collectives, DDP and ZeRO.
"""

__version__ = "0.1.0"
