"""The HTTP server: OpenAI (chat, completions, responses, embeddings) and Anthropic shapes, the console,
the HTTP edge (guard, protocol, limits) and the off-loop request preparation."""
