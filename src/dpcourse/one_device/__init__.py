"""Part 1, one device: the data, the models, the training loop and the memory they take.

Every later chapter trains these models on this data: what changes is how many devices share the
work. Start with :mod:`.training` (one step), then :mod:`.memory` (the estimate) beside
:mod:`.memory_measurement` (the measurement).

Chapter 1: training on one device.
"""
