"""Cost and capacity planning: the cost model (cost.py), the environment/inference matching rule (capacity.py), the
devices a run holds (hardware.py), a recipe's figures (recipe.py), and `loomrl plan`'s model of a run calibrated from a
finished run's measurements (measure.py, predict.py). docs/planning.md is the user's account of all of them."""
