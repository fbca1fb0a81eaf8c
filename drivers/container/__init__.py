"""What the docker and podman drivers share: CDI injection, labels, leases, keepalive.

A container sandbox is a container started from the user's image (``--image``, or the
spec's ``image``) with no network, no capabilities, ``no-new-privileges``, and no devices
but the CDI devices of the GPUs it was given. GPUs come from the host-wide lease registry,
so a GPU held by any local driver's sandbox is never handed out again. Every container
carries labels: the session, the sandbox id, the driver and the CDI devices it holds.

A lease's holder is the container itself: the lease lives while the engine knows the
container, so removing it out-of-band (``docker rm -f``) frees its GPUs. Containers are
started with auto-remove, so a container whose main process dies is gone too. The main
process reads a FIFO (the keepalive) whose write end only the creating process holds: when
the creator dies, the read sees end-of-file, the container exits and is removed, and its
GPUs come back, as a bubblewrap sandbox dies with its parent.
"""

from drivers.container.api import API_TIMEOUT_S as API_TIMEOUT_S
from drivers.container.api import EXEC_API_TIMEOUT_S as EXEC_API_TIMEOUT_S
from drivers.container.api import LIVENESS_TIMEOUT_S as LIVENESS_TIMEOUT_S
from drivers.container.api import STOP_TIMEOUT_S as STOP_TIMEOUT_S
from drivers.container.api import ContainerRequest as ContainerRequest
from drivers.container.api import EngineError as EngineError
from drivers.container.api import client_cache as client_cache
from drivers.container.driver import ContainerDriver as ContainerDriver
from drivers.container.keepalive import KEEPALIVE_PATH as KEEPALIVE_PATH
from drivers.container.keepalive import KEEPALIVE_SCRIPT as KEEPALIVE_SCRIPT
from drivers.container.sandbox import ContainerSandbox as ContainerSandbox
from drivers.labels import DEVICES_LABEL as DEVICES_LABEL
from drivers.labels import DRIVER_LABEL as DRIVER_LABEL
from drivers.labels import SANDBOX_LABEL as SANDBOX_LABEL
from drivers.labels import SESSION_LABEL as SESSION_LABEL
