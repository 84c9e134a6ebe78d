"""Part 7, communicating less over slow links: compressed gradients, local SGD and DiLoCo.

Chapters 6 to 11 make each step's communication faster; where the link between the machines is
the bottleneck, chapter 12 sends less instead. Gradients compressed inside DDP's buckets, as
communication hooks that run on torch's DDP and on the course's (:mod:`.compression`: fp16 and
bf16; :mod:`.powersgd`: low-rank factors with error feedback); parameters averaged every H steps
instead of gradients every step (:mod:`.local_sgd`); DiLoCo's inner and outer optimizers
(:mod:`.diloco`) and Streaming DiLoCo's fragments, overlapped and quantised
(:mod:`.quantization`, :mod:`.streaming_diloco`); and chapter 10's step-time model for methods
that communicate every H steps or compress by a factor c (:mod:`.step_model`).

Chapter 12: training over slow links by communicating less.
"""
