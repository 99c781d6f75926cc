"""What runs one rank's iterations: the model runner (forward passes over both KV pools), the
start-up profiler, fault injection, and rank 0's tensor-parallel workers. vLLM's ``v1/worker``
and its multiprocess executor."""
