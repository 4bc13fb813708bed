"""`loomrl compare`: arms of a recipe over seeds, paired by seed, and a decision fixed in advance (docs/compare.md)."""
