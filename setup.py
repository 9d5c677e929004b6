"""Only the C extension lives here (the rest of the metadata is in pyproject.toml).

charllm_nemo._hot holds the training thread's hot paths in C (src/charllm_nemo/speedups.py). It is
optional: without a C compiler the install goes on and their Python twins run.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("charllm_nemo._hot", ["src/charllm_nemo/_hot.c"], optional=True)])
