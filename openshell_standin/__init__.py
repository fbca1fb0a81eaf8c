"""A stand-in for OpenShell's gateway, so that OpenShell's real CLI can be run end to end here.

OpenShell's gateway, supervisor and sandbox images come only from GitHub releases and
ghcr.io, which this project's machines cannot reach; its CLI comes from PyPI
(``scripts/openshell.sh install``). This package is **not OpenShell**: it is a gateway of the
suite's own, built on the gRPC code generated from OpenShell's API (``openshell/_proto`` of
the same wheel) and ``grpcio``, that serves the RPCs the CLI's ``sandbox create``, ``exec``,
``get``, ``list`` and ``delete`` call, and enforces the rules OpenShell's gateway applies to
them, as its source (release v0.0.111) has them: each rule cites the file and line. Its
sandboxes are the reference driver's bubblewrap sandboxes, their GPUs leased from the host
registry; the request's ``driver_config`` block it forwards is that of the compute driver it
stands in for (docker by default).

What it does differently from OpenShell, on purpose: no policy, providers, SSH or
workspaces beyond ``default``; no terminal for a main process or a command; stdin is not
passed to commands; an image names nothing (the sandbox's root is the host's system
directories, as the reference driver's); a command past ``--timeout`` is killed.

``python -m openshell_standin`` serves one (``--help``); ``openshell_standin.client`` runs
the CLI against it.
"""
