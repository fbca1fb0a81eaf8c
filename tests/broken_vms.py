"""The planted VFIO binder's old import path, for tests/test_vfio.py.

The planted broken vm drivers and ``BindingNotRestored`` are in ``tests/breakers/vms.py``.
"""

from tests.breakers.vms import BindingNotRestored as BindingNotRestored
