"""An example of your own model and data for commlab (examples/own-model.yaml): any package on PYTHONPATH."""
