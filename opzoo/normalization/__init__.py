"""Normalisation layers (fixed-annotation entries): ``entries.py`` (operators with a fixed annotation).

Importing this package registers nothing; ``import opzoo`` loads its modules in the catalogue's order."""
