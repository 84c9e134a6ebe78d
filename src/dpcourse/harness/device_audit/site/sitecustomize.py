"""Start the device audit in this Python process when ``DPCOURSE_DEVICE_AUDIT`` asks for it.

``make audit`` (and tests that run notebooks audited) put this folder first on ``PYTHONPATH``;
Python imports ``sitecustomize`` at start-up, so every kernel, fork server and torchrun worker
they start is audited from its first line, as a GPU machine would be from its first tensor.

Chapter 0: the course-wide machinery (the device audit).
"""

import os

if os.environ.get("DPCOURSE_DEVICE_AUDIT", "") not in ("", "0"):
    from dpcourse.harness.device_audit import enable_if_requested

    enable_if_requested()
