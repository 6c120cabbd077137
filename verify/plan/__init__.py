"""Plans checked by the harness: every (operator, partition) pair of a plan verified on ranks
(:mod:`.check`, :mod:`.offline`, at reduced lengths: :mod:`.shrink`), handed to the compiler as its
verifier (:mod:`.verifier`)."""
