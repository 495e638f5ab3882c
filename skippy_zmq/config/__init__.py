"""Every frozen configuration dataclass and the topology YAML loader: the model's shape (model),
the topology and its sections (topology), the HTTP edge (http), driver-side speculation (speculative)."""
