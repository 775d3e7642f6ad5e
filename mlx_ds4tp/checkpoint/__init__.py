"""A model's files on disk: resolving --model, reading one rank's part of a tensor."""
