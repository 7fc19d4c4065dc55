"""Shared test setup.

The transformer_lens agreement tests save tiny models to a temporary folder and load them back;
they must never reach the network. huggingface_hub reads HF_HUB_OFFLINE when it is first
imported, so it is set here, before any test module imports transformers.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


def machine_slowdown() -> float:
    """How much slower than an idle machine this one is now: the 1-minute load per core, at least 1.
    Time bounds in the tests are multiplied by it, so that they stop a hang, never a slow correct run."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
