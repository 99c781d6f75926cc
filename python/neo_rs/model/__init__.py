"""Models and their weights: the Llama family (``llama``), loading from Hugging Face safetensors
(``loader``) and GGUF (``gguf``), prepacked CPU linears (``packed``), model resolution
(``registry``) and the built-in demo model (``demo``)."""
