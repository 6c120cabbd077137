"""Factories, ``new_*``/``*_like`` tensors, casts and metadata asserts: ``rules.py`` (annotation rules derived
per call), ``examples.py`` (the rules' verified example calls).

Importing this package registers nothing; ``import opzoo`` loads its modules in the catalogue's order."""
