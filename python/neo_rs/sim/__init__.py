"""Offload simulator (``python -m neo_rs.sim``): the real Rust scheduler against a hardware cost
model, to ask whether CPU offloading pays on a GPU + host for a model and workload."""
