"""Serving benchmark over the OpenAI API (``python -m neo_rs.bench``): seeded workloads and
arrival processes, latency/throughput metrics, neo_rs's offload figures scraped from
``/metrics``, a table, a JSON file and PNG plots."""
