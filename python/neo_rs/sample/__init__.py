"""Sampling: the request parameters and the sampler (``sampling``), and structured outputs with
their grammars and token masks (``structured``)."""
