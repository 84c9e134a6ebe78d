"""Cost models and the hardware figures they use: what a step costs before anyone runs it.

:mod:`.hardware` holds the published figures of GPUs and links that chapters 5-10 quote;
:mod:`.costmodel` is the alpha-beta model of a collective (chapter 6) and :mod:`.simulate` runs the
course's collectives on a simulated network (chapter 6); :mod:`.scaling` puts compute and
communication together into a step time and an efficiency, and :mod:`.noise_scale` says how big a
batch can usefully be (chapter 10).

Chapter 5: cost models and hardware figures (the folder serves chapters 5 to 10).
"""
