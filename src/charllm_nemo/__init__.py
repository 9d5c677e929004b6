"""charllm-nemo: power, thermal and performance telemetry for distributed LLM training.

Importing the package needs none of the vendor libraries (nvidia-ml-py, amdsmi) nor
any training framework; they are imported lazily by the parts that use them.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
