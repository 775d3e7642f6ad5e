# setuptools needs setup.py only for cffi_modules: the C module is compiled at install time.
from setuptools import setup

setup(cffi_modules=["mlx_ds4tp/_verbs_build.py:ffibuilder"])
