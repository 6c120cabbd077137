"""The verdict: tolerances and tensor comparisons (:mod:`.compare`), and a case's status from its
ranks' answers (:mod:`.verdict`)."""
