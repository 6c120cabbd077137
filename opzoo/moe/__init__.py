"""Mixture of experts: ``rules.py`` (annotation rules derived per call), ``examples.py`` (the rules' verified
example calls), ``experts.py`` (``nnscaler::moe_experts``: operator, rule, examples, module rewrites).

Importing this package registers nothing; ``import opzoo`` loads its modules in the catalogue's order."""
