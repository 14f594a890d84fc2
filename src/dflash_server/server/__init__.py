"""HTTP layer: OpenAI (Chat Completions, Completions, Responses) and Anthropic (Messages)
APIs over the engine. No torch here: the engine and tokenizer do the model work."""
