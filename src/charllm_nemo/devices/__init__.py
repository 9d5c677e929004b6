"""Device backends behind one protocol (see base.py) and the factory that picks one."""

from charllm_nemo.devices.base import Backend, Device, DeviceIdentity
from charllm_nemo.devices.factory import BACKEND_NAMES, open_backend

__all__ = ["BACKEND_NAMES", "Backend", "Device", "DeviceIdentity", "open_backend"]
