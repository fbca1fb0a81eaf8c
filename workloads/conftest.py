"""Workload tests (CuPy, PyTorch) arrive with the workloads lane; the root plugin applies."""
