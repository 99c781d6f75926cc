"""The KV cache's tensors (the Rust core keeps their block accounting): the device and host pools
(``pools``), the one door for device<->host bytes (``transfer``), and layer-by-layer block copies
(``layer_copies``). Below attention, which reads the pools and moves CPU decodes' rows through the
door."""
