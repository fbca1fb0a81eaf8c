"""The GPU sandbox conformance catalogue: requirements, their tests, and the pytest plugin.

Installed, ``pytest --pyargs conformance --driver=mypkg.mymodule:MyDriver`` runs the
catalogue against a driver of your own from any directory; ``conformance.plugin`` (loaded
through the ``pytest11`` entry point) adds the options, fixtures and reports.
"""

import gpuhost  # noqa: F401  (first: this project's packages are its own, gpuhost.ownnames)
