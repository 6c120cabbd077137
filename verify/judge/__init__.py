"""The verdict: tolerances and tensor comparisons (:mod:`.compare`), a rank's answer (:mod:`.answer`), a
case's status from its ranks' answers (:mod:`.verdict`) and the row it becomes (:mod:`.row`)."""
