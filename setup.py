"""Two compiled modules, built at install time:

- ``mlx_ds4tp._verbs`` (C, cffi API mode; mlx_ds4tp/_verbs_build.py): the TCP gate, the RDMA
  providers and the exchange every collective runs;
- ``mlx_ds4tp._pairgroup`` (C++20, nanobind; mlx_ds4tp/csrc/mlx/): the MLX distributed backend,
  compiled against the MLX this build sees. It must share MLX's nanobind domain (NB_DOMAIN=mlx)
  and internals ABI (nanobind 3.1.0 for MLX 0.32), or MLX would not recognise its groups; and
  it runs only under the MLX version it was built against, which the package therefore pins
  (``install_requires``) and checks at import (mlx_ds4tp/collectives/backend.py).

``python setup.py build_ext --inplace`` builds both in the source tree.
"""

import os
import sys

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("mlx_ds4tp", "csrc")


def mlx_build_facts():
    """(the MLX version, its include directory, its library directory), from the MLX this
    build runs with (the build environment's: pyproject.toml's build requirements)."""
    import mlx.core

    root = os.path.dirname(os.path.abspath(mlx.core.__file__))
    return mlx.core.__version__, os.path.join(root, "include"), os.path.join(root, "lib")


def pairgroup_extension(include: str, lib: str) -> Extension:
    import nanobind

    if sys.platform == "darwin":
        # The wheel's own layout (site-packages/mlx/lib beside site-packages/mlx_ds4tp), then
        # where this build found it (an editable or --no-build-isolation install).
        rpaths = ["-Wl,-rpath,@loader_path/../mlx/lib", f"-Wl,-rpath,{lib}"]
    else:
        rpaths = ["-Wl,-rpath,$ORIGIN/../mlx/lib", f"-Wl,-rpath,{lib}"]
    return Extension(
        "mlx_ds4tp._pairgroup",
        sources=[
            os.path.join(CSRC, "mlx", "group.cpp"),
            os.path.join(CSRC, "mlx", "ring.cpp"),
            os.path.join(CSRC, "mlx", "module.cpp"),
            os.path.relpath(os.path.join(nanobind.source_dir(), "nb_combined.cpp"), HERE),
        ],
        include_dirs=[
            CSRC,
            include,
            nanobind.include_dir(),
            os.path.join(os.path.dirname(nanobind.include_dir()), "ext", "robin_map", "include"),
        ],
        define_macros=[("NB_DOMAIN", "mlx"), ("NDEBUG", "1")],
        library_dirs=[lib],
        libraries=["mlx"],
        extra_compile_args=["-std=c++20", "-O2", "-fvisibility=hidden", "-fno-strict-aliasing"],
        extra_link_args=rpaths,
        depends=[os.path.join(CSRC, "mlx", name) for name in ("group.h", "dtypes.h")]
        + [os.path.join(CSRC, name) for name in ("_verbs_api.h", "exchange_codes.h", "exchange_names.h")],
        language="c++",
    )


def mlx_requirement(version: str) -> str:
    extra = "" if sys.platform == "darwin" else "[cpu]"
    return f"mlx{extra}=={version}"


mlx_version, mlx_include, mlx_lib = mlx_build_facts()
setup(
    cffi_modules=["mlx_ds4tp/_verbs_build.py:ffibuilder"],
    ext_modules=[pairgroup_extension(mlx_include, mlx_lib)],
    install_requires=[
        mlx_requirement(mlx_version),
        "mlx-lm>=0.20",
        "numpy>=1.24",
        "cffi>=1.16",
        # the digest of a part's files, checked on both sides of a transfer (checkpoint/parts_cache.py)
        "blake3>=0.4",
        # ds4tp serve's GET /metrics (the Prometheus text format)
        "prometheus_client>=0.17",
        # finding the peer: DNS-SD over multicast DNS (link/discovery.py)
        "zeroconf>=0.131",
        "ifaddr>=0.2",  # the interfaces' addresses (zeroconf's own dependency, used directly)
        # constrained decoding (JSON Schema, strict tool calls): lockstep/sampling/grammar.py says why this engine
        "llguidance>=1.0",
        # ds4tp serve's HTTP face: an ASGI application on one event loop (h11 comes with uvicorn)
        "starlette>=0.37",
        "uvicorn>=0.30",
    ],
)
