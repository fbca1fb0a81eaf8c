"""The workload lane: CuPy and PyTorch payloads run inside the sandboxes, from a manifest."""

import gpuhost  # noqa: F401  (first: this project's packages are its own, gpuhost.ownnames)
