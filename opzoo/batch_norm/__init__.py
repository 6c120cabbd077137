"""Batch norm: ``rules.py`` (annotation rules derived per call, here with their examples).

Importing this package registers nothing; ``import opzoo`` loads its modules in the catalogue's order."""
