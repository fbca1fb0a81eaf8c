"""The workload lane: CuPy and PyTorch payloads run inside the sandboxes, from a manifest."""
