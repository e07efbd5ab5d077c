"""Speculative decoding: proposers that guess a request's next tokens cheaply, for the target model to
check all at once. Every proposer runs in the model runner after a step's tokens are sampled
(kvloom/worker/speculator.py, which also builds the model proposers); the scheduler only carries the drafts
into the next step and reserves their slots. The rejection sampler that keeps the target's distribution exact
is kvloom/sample/rejection_sampler.py.

    policy.py       which requests take drafts (``can_speculate``) and how many this step; no torch
    ngram.py        n-gram prompt lookup (no model, no torch)
    draft_model.py  a smaller Llama/Mistral with the target's vocabulary
    eagle.py        an EAGLE-1 / EAGLE-3 head fed with the target's hidden states

The package imports nothing from kvloom.worker or kvloom.engine (the runner hands a draft model the function
that builds its inputs, ``draft_model.BuildInputs``), and this file imports nothing: the scheduler reads
``policy`` without loading torch.
"""
