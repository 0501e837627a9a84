"""The device side of federated training: one per-client training function and its update helpers.

The same `train_client` runs inside the in-process simulation (research.federated), as a Ray task, and
in a device process answering the protocol's round messages (`device.FederatedDevice`,
`python -m splitface.device.federated`): it takes plain tensors (global weights, the client's images and labels)
and returns plain tensors (a clipped backbone delta), so any transport can carry its inputs and outputs.
A device never imports server code.
"""
from splitface.device.federated.local_round import ClientResult, LocalConfig, train_client
from splitface.device.federated.update import clip_delta, delta_norm, flat_delta

__all__ = ["ClientResult", "LocalConfig", "clip_delta", "delta_norm", "flat_delta", "train_client"]
