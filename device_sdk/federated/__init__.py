"""The device side of federated training: one per-client training function and its update helpers.

The same `train_client` runs inside the in-process simulation (edge_server.federated), would run as a
Ray task, and on a real device process once the round messages exist in the protocol: it takes plain
tensors (global weights, the client's images and labels) and returns plain tensors (a clipped backbone
delta), so any transport can carry its inputs and outputs. A device never imports server code.
"""
from .client import ClientResult, LocalConfig, train_client
from .update import clip_delta, delta_norm, flat_delta

__all__ = ["ClientResult", "LocalConfig", "clip_delta", "delta_norm", "flat_delta", "train_client"]
