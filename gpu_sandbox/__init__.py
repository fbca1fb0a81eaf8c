"""``gpu-sandbox``: create, inspect and clean up GPU sandboxes of any driver by hand.

The command sits above the drivers and the host layer and nothing imports it: ``flags``
maps the command line's GPU flags to the request spec, ``options`` reads the command line,
``cli`` calls the command it names, ``commands`` holds each command in a module of its own,
and ``inventory`` gathers what ``gpu-sandbox gpus`` lists.
"""

import gpuhost  # noqa: F401  (first: this project's packages are its own, gpuhost.ownnames)
