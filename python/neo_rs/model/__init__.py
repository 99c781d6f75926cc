"""Llama-family models and their weight loading from Hugging Face safetensors."""

from neo_rs.model.llama import DecoderLayer, LlamaForCausalLM
from neo_rs.model.loader import load_model

__all__ = ["DecoderLayer", "LlamaForCausalLM", "load_model"]
