"""The spellings an exact ID may take, and which devices each names: one table.

A driver declares the forms it takes (``DriverCapabilities.id_forms``); ``ids_of`` writes a
device's IDs in them, in the declared order (the first is the one the catalogue names a
device by), and ``forms_text`` says them in words, for errors and listings. Only a driver
whose names are truly native (an engine's CDI kind, a cluster that takes none) writes its
own ``device_ids``. A PCI address names its device in either letter case
(``devices.pci_spellings``), whichever form wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Final

from gpuhost.devices import GpuDevice

ID_FORMS: Final = ("index", "uuid", "cdi", "pci", "dri")
"""What an exact ID may be, by name (an external driver's manifest says ``idForms`` so)."""


_WRITTEN: Final[Mapping[str, Callable[[GpuDevice], tuple[str, ...]]]] = {
    "index": lambda gpu: (str(gpu.index),) if gpu.vendor == "nvidia" and not gpu.is_mig else (),
    "uuid": lambda gpu: (gpu.uuid,),
    "cdi": lambda gpu: gpu.cdi_names,
    "pci": lambda gpu: () if gpu.is_mig else (gpu.pci_bus_id,),
    "dri": lambda gpu: gpu.dri_paths if gpu.vendor != "nvidia" else (),
}
"""Each form, as it writes a device's IDs: none where the form does not name the device."""

FORM_TEXT: Final[Mapping[str, str]] = {
    "index": "a host index (an NVIDIA GPU's)",
    "uuid": "a UUID (GPU-…, MIG-…)",
    "cdi": "a CDI name (<kind>=<index>, <kind>=<UUID>, <kind>=<gpu>:<instance>)",
    "pci": "a whole GPU's PCI address",
    "dri": "an AMD or Intel GPU's DRI node path (/dev/dri/card1)",
}


def check_forms(forms: Iterable[str]) -> tuple[str, ...]:
    """``forms`` as a tuple, each one of ``ID_FORMS`` and none twice; else ValueError."""
    forms = tuple(forms)
    unknown = [form for form in forms if form not in ID_FORMS]
    if unknown or len(set(forms)) != len(forms):
        raise ValueError(f"id forms {list(forms)}: each must be one of {list(ID_FORMS)}, once")
    return forms


def ids_of(gpu: GpuDevice, forms: Iterable[str]) -> tuple[str, ...]:
    """The IDs that name ``gpu`` in ``forms``, in that order, each once."""
    return tuple(dict.fromkeys(name for form in forms for name in _WRITTEN[form](gpu)))


def forms_text(forms: Iterable[str]) -> str:
    """``forms`` in words: "a host index (an NVIDIA GPU's), a UUID (...) or ..."."""
    words = [FORM_TEXT[form] for form in forms]
    if len(words) < 2:
        return "".join(words) or "none"
    return f"{', '.join(words[:-1])} or {words[-1]}"
