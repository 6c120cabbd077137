"""The compile driver: from a single-device model to this rank's module (:mod:`.parallelize`, and
:mod:`.pipeline` for stages), through a checked plan (:mod:`.plan`), the verification gate
(:mod:`.gate`) and the generated programs (:mod:`.artifacts`)."""
