"""Communication: conversions between tensor layouts on the plan's rank mesh."""
