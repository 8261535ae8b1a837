"""`pagevis attach`: a real vLLM / SGLang engine's prefix cache, rebuilt from the KV events it publishes over ZMQ.

No Qt here (tests/test_attach_state.py checks): the window renders `EngineState.snapshot()` results.
- events.py: the wire format (decode every known variant, bounded; encode vLLM ≥ 0.26).
- state.py: `EngineState`, `Fleet`: the blocks, forest, counters, rates, lifetimes, hot prefixes, snapshots.
"""

from pagevis.attach.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    DecodeError,
    decode_payload,
    encode_batch,
)
from pagevis.attach.state import EngineSnapshot, EngineState, Fleet, FleetSnapshot, StateLimits

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "DecodeError", "DecodedBatch", "EngineSnapshot",
           "EngineState", "Fleet", "FleetSnapshot", "StateLimits", "decode_payload", "encode_batch"]
