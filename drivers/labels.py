"""The one vocabulary every driver stamps its sandboxes with, wherever its engine takes labels.

Kubernetes' syntax of a label key, which docker and podman take as it is: a DNS subdomain
as its prefix, then ``/`` and a name. A session's sandboxes are found by ``SESSION_LABEL``
(with ``DRIVER_LABEL``, a driver's own among them).
"""

from __future__ import annotations

from typing import Final

LABEL_PREFIX: Final = "gpu-sandbox.dev/"
SESSION_LABEL: Final = LABEL_PREFIX + "session"
"""The session id the sandbox was created in: what ``reap`` looks for."""
SANDBOX_LABEL: Final = LABEL_PREFIX + "sandbox"
"""The sandbox's id, as the driver gave it."""
DRIVER_LABEL: Final = LABEL_PREFIX + "driver"
"""The driver's name, where two drivers share an engine."""
DEVICES_LABEL: Final = LABEL_PREFIX + "cdi-devices"
"""The CDI devices a container holds, comma separated."""
REQUEST_LABEL: Final = LABEL_PREFIX + "request"
"""The id the adapter gave a create it hands to an external driver, before its own id is known."""
