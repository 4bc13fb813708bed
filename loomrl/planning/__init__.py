"""Cost and capacity planning: the seed's cost model (cost.py), its environment/inference matching rule
(capacity.py), and `loomrl plan`'s model of a run calibrated from a finished run's measurements (measure.py,
predict.py)."""
