"""The host layer every driver stands on.

The request model and its typed errors, the GPU devices and their discovery, the host-wide
lease registry, CDI specs, and the simulated GPU host. It imports no driver: drivers
register what the layer must ask them (the liveness of their lease holders) through
``gpuhost.leases.register_liveness`` or entry points.
"""

from gpuhost import ownnames

ownnames.install()
