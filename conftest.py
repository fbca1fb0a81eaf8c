"""The suite's pytest plugin is ``conformance.plugin`` (and ``workloads.plugin``).

Both are registered as ``pytest11`` entry points of the installed project, so that
``pytest --pyargs conformance`` runs the catalogue from any directory; nothing to load here.
"""
