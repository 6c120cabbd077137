"""Where a failing whole-model case's programs part ways: the first divergent operator, stage or replica."""
