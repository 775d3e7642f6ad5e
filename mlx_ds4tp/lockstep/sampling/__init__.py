"""How tokens are drawn, alike on every rank: the sampling options, the one row sampler,
speculative decoding's acceptance rule, and grammars as token masks."""
