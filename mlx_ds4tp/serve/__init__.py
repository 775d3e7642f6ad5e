"""ds4tp serve, in the order a request goes through it: the HTTP face (http/), the API dialects
(dialects/), the batching engine on the leader (engine/); pair.py brings up both ranks."""
