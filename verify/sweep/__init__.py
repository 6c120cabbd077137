"""``verify all``'s machinery: its units (selection), running them (drive), the verdict cache, shards and their merge, and the command."""
