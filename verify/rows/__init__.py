"""The parent's side of a case: run on a gang, its ranks' answers judged into rows (operators, models, replicas, torch parallelizations)."""
