"""Text in and out: vocabularies and tokenizers, chat templates (under a budget), grammar constraints
over the vocabulary, and the output side: reasoning and tool-call streams over decoded text."""
