"""Whole models the harness verifies end to end (and the examples use)."""
