"""ahcomm's one C extension, optional: non-temporal copies into large outputs (ahcomm/_ntcopy.c).
Where it does not build (no C compiler) ahcomm installs without it and copies with numpy.
Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ahcomm._ntcopy", ["ahcomm/_ntcopy.c"], optional=True)])
