"""A client's request -> a validated, tokenized core.requests.GenerationRequest: the sampling checks and
limits, chat messages -> prompt ids, output constraints (their size checks here, their compile in the
grammar sandbox), and the builder that funnels every API through the same verdicts.

Imports gateway.text only, of the gateway's rooms.
"""
