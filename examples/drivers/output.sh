#!/bin/sh
# Prints the run that docs/writing-a-driver.md shows: the catalogue against jail.py on the
# gate's host layout (that of `make conformance`), from a directory of its own, as a driver's
# own repository runs it. As root: examples/drivers/output.sh (PYTEST: which pytest, by default
# this checkout's .venv/bin/pytest). tests/conformance/test_example_driver.py checks the page against a run.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
pytest=${PYTEST:-$here/../../.venv/bin/pytest}
repository=$(mktemp -d)
trap 'rm -rf "$repository"' EXIT
cp "$here/jail.py" "$repository/"
cd "$repository"
set -- --pyargs conformance --driver=jail:JailDriver --sim-gpus=8 \
    --sim-mig=0:7x1g.10gb,1:3x2g.20gb,1:1g.10gb --sim-dri=intel:1,amd:2 -p no:cacheprovider
echo "\$ PYTHONPATH=. pytest $*"
PYTHONPATH=. "$pytest" "$@"
