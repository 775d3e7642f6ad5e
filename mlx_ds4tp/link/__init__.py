"""The transport between the two ranks (behind transport.py): wire format, configuration,
control channel, hello, the exchange, pair."""
