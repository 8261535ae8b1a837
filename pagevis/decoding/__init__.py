"""pagevis.decoding: step-by-step decoding sessions over the paged engine. NumPy only, never Qt."""

from .oracle import FullCacheOracle
from .record import OracleStep, StepRecord, TierStep
from .sampling import Sampler, SamplingConfig
from .session import DecodeSession, SessionConfig
from .spec import ModelSpec

__all__ = ["FullCacheOracle", "OracleStep", "StepRecord", "TierStep", "Sampler", "SamplingConfig",
           "DecodeSession", "SessionConfig", "ModelSpec"]
