"""Device backends behind one protocol, and the contract their readings follow.

The public API (what a user or an integration may import from here):

* :class:`Device`, :class:`Backend`, :class:`DeviceIdentity` (base.py): the protocol every
  backend implements (``Device.read()`` returns a :data:`Reading`; it raises only
  :class:`~charllm_nemo.errors.DeviceLost`).
* :data:`METRICS`, :data:`METRIC_NAMES`, :data:`Reading`, :data:`THROTTLE_BITS`,
  :func:`decode_throttle` (contract.py): the metrics a reading holds, in order, with their units
  in their names (W, mJ, J, °C, MHz, bytes, ns), and the throttle reasons' bits.
* :func:`open_backend`, :data:`BACKEND_NAMES` (factory.py): open ``nvml``, ``amdsmi``,
  ``synthetic`` or ``auto`` (NVML, then AMD SMI, then synthetic with a warning). Vendor
  libraries are imported only when their backend is opened.
"""

from charllm_nemo.devices.base import Backend, Device, DeviceIdentity
from charllm_nemo.devices.contract import METRIC_NAMES, METRICS, THROTTLE_BITS, Reading, decode_throttle
from charllm_nemo.devices.factory import BACKEND_NAMES, open_backend

__all__ = [
    "BACKEND_NAMES",
    "METRICS",
    "METRIC_NAMES",
    "THROTTLE_BITS",
    "Backend",
    "Device",
    "DeviceIdentity",
    "Reading",
    "decode_throttle",
    "open_backend",
]
