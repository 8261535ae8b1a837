"""What a benchmark ran on, printed beside its tables: the CPU, NumPy and its BLAS build (with the kernel
OpenBLAS chose for this CPU), the BLAS threads, and the load average while each table was measured. Ratios
measured on one machine say little about another (docs/model.md: the same code reached 0.81 of its read floor
on one CPU and 0.58 on an AMD EPYC of this project's machine kind)."""

from __future__ import annotations

import os

import numpy as np

from pagevis.model.blas_threads import blas_description
from pagevis.model.matmul import cpu_model


def load_average() -> float | None:
    """The 1-minute load average, or None where the system has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def describe() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "numpy": np.__version__, "blas": blas_description(),
            "load": load_average()}


def machine_line(info: dict) -> str:
    load = "" if info.get("load") is None else f" · load {info['load']:.2f} at the start"
    return (f"Machine: {info['cpu']} ({info['cores']} cores) · NumPy {info['numpy']} · BLAS {info['blas']}{load}")


def load_note(loads: dict, section: str) -> str:
    """' (load 1.23)': the load average when a table's measurement ended, for its heading."""
    value = (loads or {}).get(section)
    return "" if value is None else f" (load {value:.2f})"
