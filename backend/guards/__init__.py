"""Guards: what each sequence may draw and when it ends (policy), the thinking phase and
its budget, loop detectors, the token-level tool-call guards."""
