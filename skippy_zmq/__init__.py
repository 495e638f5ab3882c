"""skippy_zmq: pipeline-parallel LLM inference over ZeroMQ with JAX stages."""

__version__ = "0.1.0"
