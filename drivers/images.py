"""The image a container or pod sandbox runs when neither the request nor ``--image`` names one.

The docker, podman and kubernetes drivers share it: ``make engines`` builds it from a busybox
rootfs for the container engines, and ``make cluster`` builds the same one into its node.
"""

DEFAULT_IMAGE = "gpu-sandbox-busybox:latest"
"""The base image ``make engines`` builds from a busybox rootfs (no registry needed)."""
