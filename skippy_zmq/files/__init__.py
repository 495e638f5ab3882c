"""Reading untrusted model files safely, and the folders that are ours: file checks, the bounded GGUF
layout parser, private cache folders, fetching a model. Imports nothing else of skippy_zmq."""
