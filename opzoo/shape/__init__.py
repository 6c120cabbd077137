"""Reshapes, permutations, ``expand``: ``entries.py`` (operators with a fixed annotation), ``rules.py``
(annotation rules derived per call), ``examples.py`` (the rules' verified example calls).

Importing this package registers nothing; ``import opzoo`` loads its modules in the catalogue's order."""
