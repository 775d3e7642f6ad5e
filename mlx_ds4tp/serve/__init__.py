"""ds4tp serve: the HTTP APIs on the leader, the batching engine."""
