"""Speculative decoding: proposers that guess a request's next tokens cheaply, for the target model to
check all at once (issue 10). The rejection sampler that keeps the target's distribution exact lives
in kvloom/sample/rejection_sampler.py."""
