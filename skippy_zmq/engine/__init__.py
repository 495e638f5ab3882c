"""The driver's engine: requests and token events (request), the scheduler that plans every row,
speculation, the prefix index, the socket pipeline, its metrics and the single-process engines."""
