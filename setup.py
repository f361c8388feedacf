"""Build hook: compiles the cffi libfabric bindings (fabric/_ffi_build.py) at install time."""
import os

from setuptools import setup

cffi_modules = []
if os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "fabric", "_ffi_build.py")):
    cffi_modules.append("fabric/_ffi_build.py:ffibuilder")

setup(cffi_modules=cffi_modules)
