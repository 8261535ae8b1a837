"""pagevis.engine: the engine (scheduler, batched steps, sampling), its one run loop and the one-request
session the app uses. NumPy only, never Qt."""

from pagevis.engine.engine import Engine
from pagevis.engine.oracle import FullCacheOracle
from pagevis.engine.step_record import OracleStep, StepRecord, TierStep
from pagevis.engine.request import Request
from pagevis.engine.run_loop import RunControl, run, steps
from pagevis.engine.sampling import Sampler, SamplingConfig
from pagevis.engine.session import DecodeSession
from pagevis.engine.session_config import SessionConfig
from pagevis.engine.model_spec import ModelSpec

__all__ = ["DecodeSession", "Engine", "FullCacheOracle", "ModelSpec", "OracleStep", "Request", "RunControl",
           "Sampler", "SamplingConfig", "SessionConfig", "StepRecord", "TierStep", "run", "steps"]
