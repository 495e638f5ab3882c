"""Model files to our checkpoint and back: GGUF / safetensors sources, one reader per family,
conversion, the checkpoint format and its loader, and the GGUF writer."""
