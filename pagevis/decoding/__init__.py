"""pagevis.decoding: the engine (scheduler, batched steps, sampling), its one run loop and the one-request
session the app uses. NumPy only, never Qt."""

from .engine import Engine
from .oracle import FullCacheOracle
from .record import OracleStep, StepRecord, TierStep
from .request import Request
from .run_loop import RunControl, run, steps
from .sampling import Sampler, SamplingConfig
from .session import DecodeSession
from .session_config import SessionConfig
from .spec import ModelSpec

__all__ = ["DecodeSession", "Engine", "FullCacheOracle", "ModelSpec", "OracleStep", "Request", "RunControl",
           "Sampler", "SamplingConfig", "SessionConfig", "StepRecord", "TierStep", "run", "steps"]
