"""Worker: the draft, verify and draft-extend passes, and the token-selection math
(:mod:`specdial.worker.sampling`) of speculative decoding."""
