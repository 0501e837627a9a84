"""Federated face recognition with user-level DP (DP-FedEmb, DP-FedAvg, their non-private forms) and a
centralized baseline: `python -m research.federated --help`, docs/federated.md."""
from research.federated.rounds import METHODS, FederatedConfig, FederatedRun
from research.federated.tasks import ClientTask, in_process
from research.federated.population import Population, check_partition, load_population, virtual_clients

__all__ = ["METHODS", "ClientTask", "FederatedConfig", "FederatedRun", "Population",
           "check_partition", "in_process", "load_population", "virtual_clients"]
