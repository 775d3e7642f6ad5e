"""The API dialects `ds4tp serve` speaks (OpenAI chat/completions, Anthropic Messages, OpenAI Responses):
each parses its body into the request the engine takes and renders the engine's answer in its own shape."""
